"""The model's per-layer operations, held to transformers' own on random inputs.

`model.py` computes RMS norms with one fused call, normalises and rotates the query and key
heads side by side, and applies RoPE without building the rotated copy. Whole models are
compared with transformers elsewhere (float32); these check the operations themselves,
in bfloat16 too, where a change of rounding would show.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from nanoqwen.model.layers import RMSNorm, apply_rotary

# float32: reordered sums; bfloat16: one rounding step of the output (2^-8 relative).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
DTYPES = st.sampled_from(list(TOLERANCE))


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 40), size=st.sampled_from([16, 64, 384]), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_rms_norm_matches_transformers(tokens: int, size: int, dtype: torch.dtype, seed: int) -> None:
    torch.manual_seed(seed)
    ours, theirs = RMSNorm(size, 1e-6).to(dtype), Qwen3RMSNorm(size, 1e-6).to(dtype)
    weight = torch.randn(size).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = (torch.randn(tokens, 3, size) * 4).to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), **TOLERANCE[dtype])


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 8), head_dim=st.sampled_from([16, 64, 128]),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_rotary_matches_transformers(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> None:
    torch.manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * inv_freq  # [T, dim / 2]: what RotaryEmbedding gives
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(tokens, heads, head_dim).to(dtype)
    # transformers: full-width cos/sin, both halves alike, on [batch, heads, T, dim].
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], full_cos, full_sin)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected[0].transpose(0, 1), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rotary_reads_strided_heads(dtype: torch.dtype) -> None:
    """The model rotates query and key heads that sit side by side in one projection."""
    x = torch.randn(5, 10, 32).to(dtype)
    angles = torch.randn(5, 16)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    side_by_side = apply_rotary(x[:, :7], cos, sin)
    assert torch.equal(side_by_side, apply_rotary(x[:, :7].contiguous(), cos, sin))
