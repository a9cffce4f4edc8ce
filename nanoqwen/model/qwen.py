"""The Qwen decoder in plain torch, shaped for serving.

The maths is transformers' `Qwen2ForCausalLM` / `Qwen3ForCausalLM`:

    embed → N × [RMSNorm → attention → +residual → RMSNorm → SwiGLU MLP → +residual]
          → RMSNorm → lm_head

shaped three ways for serving: the input is one flat `[T]` vector of tokens from many
requests, each with its own position (the attention backend knows from the page table
whose token is whose); q/k/v and gate/up are fused projections (`qkv_proj`,
`gate_up_proj`), which the loader fills from the checkpoint's separate weights; and only
the rows to sample get the final norm and the lm_head, so a prefill chunk that samples
nothing skips it. Qwen2 adds a bias to q/k/v; Qwen3 RMS-normalises each q and k head
before RoPE and may tie the lm_head to the embedding (`ModelConfig`'s switches).

A decoder layer is two *kinds* composed: a mixer (what lets tokens see each other) and an
MLP. `LAYER_KINDS` names each kind's module; a model's config says which kinds each layer
has, and only the kinds a model uses are imported. Dense Qwen2/Qwen3 use the two below;
the MoE models' experts (`moe.py`), and the hybrid models' gated attention and Gated
DeltaNet (`gated_attention.py`, `gated_deltanet.py`), whose per-request state the step's
`LayerInputs.states` carries, have modules of their own.

Split across ranks, this same code builds one rank's slice: the layers (`layers.py`)
decide which heads, channels and vocabulary rows, and add up partial results themselves.

Invariant: for the same weights, the logits of every sampled row equal transformers'
(float32: within rounding; greedy ids: identical), which the tests check. The story:
docs/learn/01-forward-pass-and-kv-cache.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    apply_rotary,
    attention_splits,
    normalize,
)

# Each layer kind: the attribute a decoder layer holds it in (its name in checkpoints) and
# what builds it from `(config, layer)`, in a module imported only by models that use it.
LAYER_KINDS: dict[str, tuple[str, str]] = {
    "attention": ("self_attn", "nanoqwen.model.qwen:Attention"),
    "gated_attention": ("self_attn", "nanoqwen.model.gated_attention:gated_attention"),
    "linear_attention": ("linear_attn", "nanoqwen.model.gated_deltanet:gated_deltanet"),
    "mlp": ("mlp", "nanoqwen.model.qwen:MLP"),
    "sparse_moe": ("mlp", "nanoqwen.model.moe:sparse_moe_block"),
    "rms_norm": ("", "nanoqwen.model.layers:RMSNorm"),
    "zero_centered_rms_norm": ("", "nanoqwen.model.gated_attention:ZeroCenteredRMSNorm"),
}


@dataclass
class LayerInputs:
    """What a layer reads of the step besides the hidden states."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin `[T, rotary_dim / 2]`
    backend: AttentionBackend  # attention over the paged KV cache
    states: Any = None  # recurrent layers' per-request state, for models that have them


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.kv_layer = config.kv_layers.index(layer)  # its place in the KV cache
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads, qkv_splits, o_split = attention_splits(
            config.num_heads, config.num_kv_heads, config.head_dim
        )
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_splits, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(o_split, config.hidden_size)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # The query and key heads side by side, `[T, heads + kv_heads, dim]`: one pass of
        # each per-head operation serves both.
        qk = qk.unflatten(-1, (-1, self.head_dim))
        if hasattr(self, "q_norm"):
            qk = normalize(qk, self.q_norm.eps)
            qk[:, : self.num_heads] *= self.q_norm.weight
            qk[:, self.num_heads :] *= self.k_norm.weight
        qk = apply_rotary(qk, *inputs.rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = inputs.backend.forward(self.kv_layer, q, k, v.unflatten(-1, (-1, self.head_dim)))
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        channels = Split.even(config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [channels] * 2, bias=False)
        self.down_proj = RowParallelLinear(channels, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # SiLU and the product in place: the projection's output is ours, and a fresh tensor
        # this size would cost the CPU a page fault per 4 KiB.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


def layer_kind(kind: str) -> tuple[str, type[nn.Module]]:
    """The attribute and module class of a layer kind (see `LAYER_KINDS`)."""
    attribute, location = LAYER_KINDS[kind]
    module, name = location.split(":")
    return attribute, getattr(importlib.import_module(module), name)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        mixer_kind, mlp_kind = config.layer_kinds[layer]
        self.mixer_name, mixer = layer_kind(mixer_kind)
        mlp_name, mlp = layer_kind(mlp_kind)
        _, norm = layer_kind(config.norm_kind)
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        setattr(self, self.mixer_name, mixer(config, layer))
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        setattr(self, mlp_name, mlp(config, layer))

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        hidden = hidden + mixer(self.input_layernorm(hidden), inputs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class QwenModel(nn.Module):
    """Embedding, decoder layers and final norm; parameter names follow transformers'."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = layer_kind(config.norm_kind)[1](config.hidden_size, config.rms_norm_eps)


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """RoPE as the config scales it (dynamic scaling has a module of its own)."""
    if config.rope_type == "dynamic":
        from nanoqwen.model.rope_scaling import DynamicRotaryEmbedding

        return DynamicRotaryEmbedding(config.hf_config, config.rope_type)
    return RotaryEmbedding(config.hf_config, config.rope_type)


class QwenForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.rotary = rotary_embedding(config)
        self.lm_head = ParallelLMHead(config.hidden_size, self.model.embed_tokens)
        self.tie_weights()
        # This rank's heads, for the KV cache and the attention backend.
        first = next(layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn"))
        self.attention_shape = AttentionShape(
            len(config.kv_layers), first.num_heads, first.num_kv_heads, config.head_dim
        )

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        sample_rows: torch.Tensor,
        states: Any = None,
    ) -> torch.Tensor:
        """Run `[T]` tokens through the decoder; return the final-norm hidden states of the
        rows `sample_rows` picks, `[S, hidden]` (what `compute_logits` turns into logits,
        and an embedding request's vector)."""
        hidden = self.model.embed_tokens(input_ids)
        inputs = LayerInputs(self.rotary(metadata, hidden.dtype), backend, states)
        for layer in self.model.layers:
            hidden = layer(hidden, inputs)
        return self.model.norm(hidden[sample_rows])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[S, vocab]` logits of final-norm hidden states (on rank 0 of a split model;
        None on the others)."""
        logits = self.lm_head(hidden)
        return logits if self.lm_head.tp.size == 1 else self.lm_head.join(logits)
