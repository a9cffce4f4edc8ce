"""Gated attention: the full-attention layers of Qwen3-Next and Qwen3.5.

Every fourth decoder layer of these hybrid models is ordinary causal attention over the
paged KV cache, with three changes from Qwen3's (transformers' `Qwen3NextAttention`):

* an output gate: `q_proj` gives each head its query and, beside it, a gate of the same
  size (per head: `[query | gate]`); the attention's output is multiplied by
  sigmoid(gate) before `o_proj`, so a head can switch itself off for a token;
* partial rotary: RoPE turns only the first `rotary_dim = head_dim × partial_rotary_factor`
  dims of each query and key head (a quarter, in the released models); the rest carry no
  position at all (`partial_rotary`);
* zero-centred RMSNorm weights: the norms of q and k heads (and the decoder's input,
  post-attention and final norms) scale by (1 + w), so a weight of zeros is the identity
  (`ZeroCenteredRMSNorm`). The Gated DeltaNet's own output norm is the exception.

As in the dense decoder, q, k and v come from one fused projection (`qkv_proj`: the
checkpoint's `q_proj`, `k_proj`, `v_proj` as row blocks) and attention goes through the
`AttentionBackend`, which writes this step's keys and values into their pages and attends
over each request's pages. Split across ranks, a rank keeps whole query heads with their
gates, the KV heads they read, and `o_proj`'s matching columns.

Invariant: for the same weights, positions and cached keys, the output equals
transformers' attention layer (float32: within rounding), whatever the step's mix of
prefill chunks and decodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    Split,
    apply_rotary,
    current_group,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from nanoqwen.model.config import ModelConfig
    from nanoqwen.model.qwen import LayerInputs


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), in float32 and then rounded, as transformers'
    `Qwen3NextRMSNorm` computes it (its weight starts at zeros: the identity)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)


def partial_rotary_dim(config: PretrainedConfig) -> int:
    """How many leading dims of each head RoPE turns: `head_dim × partial_rotary_factor`
    (as transformers' rope initialisation reads the factor)."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim_of(config) * factor)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """x `[T, heads, dim]`, cos/sin `[T, rotary_dim / 2]`: RoPE on each head's first
    `rotary_dim` dims; the others pass through unchanged."""
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    turned = apply_rotary(x[..., :rotary_dim], cos, sin)
    return torch.cat([turned, x[..., rotary_dim:]], dim=-1)


class GatedAttention(nn.Module):
    """Grouped-query attention with an output gate, over this rank's heads; `layer` is the
    index the attention backend and its KV cache know this layer by."""

    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        if config.attention_bias:
            raise ValueError("gated attention with biased projections is not supported")
        self.layer = layer
        self.head_dim = head_dim_of(config)
        self.rotary_dim = partial_rotary_dim(config)
        self.num_heads, self.num_kv_heads, splits, o_split = head_splits(
            config.num_attention_heads, config.num_key_value_heads, self.head_dim
        )
        self.query_gate_size, self.kv_size = splits[0].length, splits[1].length
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, splits, bias=False)
        self.o_proj = RowParallelLinear(o_split, config.hidden_size)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """hidden `[T, hidden_size]`; `inputs.rope`: cos and sin `[T, rotary_dim / 2]` at
        each token's position; `inputs.backend` attends over the paged KV cache."""
        rope, backend = inputs.rope, inputs.backend
        sizes = [self.query_gate_size, self.kv_size, self.kv_size]
        query_gate, k, v = self.qkv_proj(hidden).split(sizes, dim=-1)
        query, gate = query_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, -1)
        key, value = (t.unflatten(-1, (-1, self.head_dim)) for t in (k, v))
        query = partial_rotary(self.q_norm(query), *rope, self.rotary_dim)
        key = partial_rotary(self.k_norm(key), *rope, self.rotary_dim)
        out = backend.forward(self.layer, query, key, value)
        return self.o_proj(out.flatten(1) * torch.sigmoid(gate.flatten(1)))


def gated_attention(config: ModelConfig, layer: int) -> GatedAttention:
    """The `gated_attention` layer kind: decoder layer `layer`, known to the KV cache by its
    place among the layers that keep K/V."""
    return GatedAttention(config.hf_config, config.kv_layers.index(layer))


def head_splits(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, list[Split], Split]:
    """This rank's query heads and KV heads, its rows of `q_proj` (each head's query and
    gate), `k_proj` and `v_proj`, and its columns of `o_proj`. With fewer KV heads than
    ranks, consecutive ranks share one: their query heads all belong to its group, so each
    keeps a copy."""
    group = current_group()
    local_heads = num_heads // group.size
    local_kv_heads = max(1, num_kv_heads // group.size)
    first_kv_head = group.rank * num_kv_heads // group.size
    query_gate = Split(group.rank * local_heads * 2 * head_dim, local_heads * 2 * head_dim)
    kv = Split(first_kv_head * head_dim, local_kv_heads * head_dim)
    outputs = Split(group.rank * local_heads * head_dim, local_heads * head_dim)
    return local_heads, local_kv_heads, [query_gate, kv, kv], outputs
