"""The Qwen2 / Qwen3 decoder in plain torch, shaped for serving.

The maths is the same as transformers' `Qwen2ForCausalLM` / `Qwen3ForCausalLM`:

    embed → N × [RMSNorm → attention → +residual → RMSNorm → SwiGLU MLP → +residual]
          → RMSNorm → lm_head

Three things differ, and they are why an engine has its own model code:

* **A flat batch.** Inputs are one `[T]` vector of token ids from many requests (a
  prefill chunk of one, one decode token of another, ...), not a padded `[B, S]` block.
  Each token carries its own position; the attention backend knows from the page table
  which request each token belongs to.
* **Fused projections.** q, k and v are one matmul (`qkv_proj`), gate and up another
  (`gate_up_proj`): fewer, larger kernels. The loader concatenates the checkpoint's
  separate weights into them.
* **Logits only where needed.** The vocabulary projection is the biggest matmul per
  token, yet only the last token of each request is sampled. `forward` takes the rows to
  sample and never builds a `[T, vocab]` tensor; a prefill chunk that samples nothing
  skips the lm_head entirely.

Qwen2 adds a bias to q/k/v; Qwen3 instead RMS-normalises each head of q and k before
RoPE and may tie the lm_head to the embedding. `ModelConfig` carries these switches.

Split across ranks, this same code builds one rank's slice of the model: the layers
(`layers.py`) decide which heads, channels and vocabulary rows that is, and add up the
partial results themselves. The logits `forward` returns are then this rank's block of
the vocabulary, which the runner joins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    attention_splits,
    normalize,
)
from nanoqwen.model.rotary import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, config.head_dim
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

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # The query and key heads side by side, `[T, heads + kv_heads, dim]`: one pass of
        # each per-head operation serves both.
        qk = qk.unflatten(-1, (-1, self.head_dim))
        if hasattr(self, "q_norm"):
            qk = normalize(qk, self.q_norm.eps)
            qk[:, : self.num_heads] *= self.q_norm.weight
            qk[:, self.num_heads :] *= self.k_norm.weight
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = backend.forward(self.layer, q, k, v.unflatten(-1, (-1, self.head_dim)))
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        channels = Split.even(config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [channels] * 2, bias=False)
        self.down_proj = RowParallelLinear(channels, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # SiLU and the product in place: the projection's output is ours, and a fresh tensor
        # this size would cost the CPU a page fault per 4 KiB.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class QwenModel(nn.Module):
    """Embedding, decoder layers and final norm; parameter names follow transformers'."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class QwenForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = ParallelLMHead(config.hidden_size, self.model.embed_tokens)
        self.tie_weights()
        attention = self.model.layers[0].self_attn
        self.attention_shape = AttentionShape(
            config.num_layers, attention.num_heads, attention.num_kv_heads, config.head_dim
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
    ) -> torch.Tensor:
        """Run `[T]` tokens through the decoder; return logits `[len(sample_rows), vocab]`
        (split across ranks: this rank's block of the vocabulary)."""
        return self.compute_logits(self.hidden_states(input_ids, metadata, backend)[sample_rows])

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata, backend: AttentionBackend
    ) -> torch.Tensor:
        """The last decoder layer's output for every token, `[T, hidden]` (before the final
        norm, which `compute_logits` applies)."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.rotary(metadata.positions, metadata, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, self.lm_head.out_features)
        return self.lm_head(self.model.norm(hidden))
