"""RoPE: each token's queries and keys rotated by angles proportional to its position.

The inverse frequencies and the cos/sin scale come from transformers' own helpers, so
`linear` and `yarn` scaling mean exactly what they mean there. Every token carries its own
position (`AttentionMetadata.positions`), which is all a flat batch of many requests needs.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.model.config import ModelConfig


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (q, k) pair of channels by an angle proportional to position.

    The inverse frequencies and the cos/sin scale come from transformers' own helpers, so
    `linear` and `yarn` scaling mean exactly what they mean there. `dynamic` (NTK) scaling
    widens the base once a sequence outgrows the trained context; transformers decides that
    from the longest sequence in the forward pass, which for one request is its own length,
    so here every token uses its own request's length.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        init = ROPE_INIT_FUNCTIONS.get(config.rope_type, _default_rope_parameters)
        inv_freq, self.attention_scaling = init(config.hf_config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, metadata: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :]
        if self.config.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(metadata)
        # Both halves of a head rotate by the same angles: `[T, head_dim / 2]` covers them.
        angles = positions[:, None].float() * inv_freq
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _dynamic_inv_freq(self, metadata: AttentionMetadata) -> torch.Tensor:
        """Per-token inverse frequencies: each token scaled for its own request's length."""
        # A request's length is one past the position of its last token in this step.
        request_lens = metadata.positions[metadata.qo_indptr[1:].long() - 1] + 1
        seq_lens = torch.repeat_interleave(request_lens, metadata.q_lens())
        inv_freq = self.inv_freq[None, :].expand(seq_lens.numel(), -1).clone()
        trained = self.config.max_position_embeddings
        for seq_len in seq_lens[seq_lens > trained].unique().tolist():
            longer, _ = ROPE_INIT_FUNCTIONS["dynamic"](
                self.config.hf_config, self.inv_freq.device, seq_len=seq_len
            )
            inv_freq[seq_lens == seq_len] = longer
        return inv_freq


def _default_rope_parameters(hf_config, device) -> tuple[torch.Tensor, float]:
    base = hf_config.rope_parameters["rope_theta"]
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, dim]`, cos/sin `[T, dim / 2]`: transformers' `x * cos +
    rotate_half(x) * sin`, where `rotate_half(x)` is `(-second half, first half)`, in three
    passes over `x` and without the rotated copy."""
    cos, sin = cos[:, None, None], sin[:, None, None]
    halves = x.unflatten(-1, (2, -1))  # [T, heads, 2, dim / 2]
    rotated = halves * cos
    rotated[:, :, 0].addcmul_(halves[:, :, 1], sin[:, :, 0], value=-1)
    rotated[:, :, 1].addcmul_(halves[:, :, 0], sin[:, :, 0])
    return rotated.flatten(-2)
