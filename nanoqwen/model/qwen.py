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

With tensor parallelism (`parallel.py`) each rank builds this same model from its share
of the shape: its heads, its MLP channels, its rows of the vocabulary. The two
row-parallel projections, `o_proj` and `down_proj`, then end in an all-reduce, and the
logits `forward` returns are this rank's slice of the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata
from nanoqwen.model.config import ModelConfig
from nanoqwen.parallel.sharding import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * normalize(x, self.eps)


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension in float32 and cast back, as transformers does
    before scaling (so bf16 results round the same way); `F.rms_norm` does it in one pass."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


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


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads (`config` is the rank's share)."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
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
        # Row-parallel: each rank's heads give a partial sum of the output; add them up.
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # SiLU and the product in place: the projection's output is ours, and a fresh tensor
        # this size would cost the CPU a page fault per 4 KiB. Row-parallel: each rank's
        # intermediate channels give a partial sum; add them up.
        return self.tp.all_reduce(self.down_proj(F.silu(gate, inplace=True).mul_(up)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's ids; other ranks fill in the rest."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first_id, rows = tp.vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        rows = input_ids - self.first_id
        mine = (rows >= 0) & (rows < self.weight.shape[0])
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce brings theirs.
        hidden = F.embedding(rows * mine, self.weight) * mine[:, None]
        return self.tp.all_reduce(hidden)


class QwenModel(nn.Module):
    """Embedding, decoder layers and final norm; parameter names follow transformers'."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class QwenForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = tp.shard_config(config)  # this rank's heads and MLP channels
        self.model = QwenModel(self.config, tp)
        self.rotary = RotaryEmbedding(self.config)
        _, vocab_rows = tp.vocab_shard(config.vocab_size)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.tie_weights()

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
        (with tensor parallelism, this rank's rows of the vocabulary)."""
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
