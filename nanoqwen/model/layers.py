"""The decoder's building blocks: RMSNorm, RoPE, and linear layers that may be split across ranks.

Every split lives here, Megatron-style, so that the decoder (`qwen.py`) reads like the
one-device model:

* column-parallel (`q/k/v`, `gate/up`): rank r keeps some output rows, whole query heads
  (with the KV heads they read) or a slice of the MLP's channels;
* row-parallel (`o_proj`, `down_proj`): rank r keeps the matching input columns, computes
  a partial sum, and an all-reduce adds the ranks' sums: two per decoder layer, the only
  communication inside one;
* vocabulary-parallel (`embed_tokens`, `lm_head`): rank r keeps a block of the
  vocabulary's rows (padded to a multiple of N); the embedding's all-reduce fills in the
  other ids, the lm_head's logits are joined on rank 0.

With one rank every split is the whole weight and every collective is skipped. Each split
parameter is loaded by its layer's `load_block` (`loading.py`), which reads only its slice
of the checkpoint tensor, so no rank ever holds a full weight it does not keep.

Invariant: the ranks' slices of a weight cover it exactly (KV heads fewer than the ranks
are replicated), and after every all-reduce all ranks hold the same hidden state. The
story, with a picture: docs/learn/13-tensor-parallelism.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.model.loading import TensorSlice, copy_checked, read_block


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of the split: its rank and the number of ranks. Collectives go
    through `torch.distributed` (gloo on the CPU, NCCL on GPUs)."""

    rank: int = 0
    size: int = 1

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's embedding and lm_head rows. Every rank has the
        same number of rows, the last padded with zeros, so the logits slices gather."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place: partial sums become the full result."""
        if self.size > 1:
            dist.all_reduce(x)
        return x


SINGLE = TensorParallel()
_current_group = SINGLE


@contextmanager
def split_across(tp: TensorParallel) -> Iterator[None]:
    """Layers built inside this block are `tp`'s rank's slices (built outside: whole)."""
    global _current_group
    previous, _current_group = _current_group, tp
    try:
        yield
    finally:
        _current_group = previous


def current_group() -> TensorParallel:
    return _current_group


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
    """RoPE: rotate each (q, k) pair of channels by an angle proportional to the position.

    The inverse frequencies and the cos/sin scale come from transformers' own helpers, so
    `linear` and `yarn` scaling (and a partial rotary factor) mean exactly what they mean
    there. Every token carries its own position (`AttentionMetadata.positions`), which is
    all a flat batch of many requests needs. (`dynamic` scaling, which depends on each
    request's length, is `rope_scaling.py`'s.)
    """

    def __init__(self, hf_config: PretrainedConfig, rope_type: str) -> None:
        super().__init__()
        init = ROPE_INIT_FUNCTIONS.get(rope_type, default_rope_parameters)
        inv_freq, self.attention_scaling = init(hf_config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, metadata: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Both halves of a head rotate by the same angles: `[T, rotary_dim / 2]` covers them.
        angles = metadata.positions[:, None].float() * self.inv_freq[None, :]
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def default_rope_parameters(hf_config: PretrainedConfig, device: object) -> tuple[torch.Tensor, float]:
    """Plain RoPE's inverse frequencies over the first `partial_rotary_factor` of a head."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    rope = hf_config.rope_parameters
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = rope["rope_theta"]
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


@dataclass(frozen=True)
class Split:
    """Which part of one checkpoint weight a rank keeps: `length` rows (or columns) from
    `start`."""

    start: int
    length: int

    @staticmethod
    def even(total: int) -> Split:
        """An equal share of `total` for this rank (the split was checked to divide)."""
        tp = current_group()
        length = total // tp.size
        return Split(tp.rank * length, length)


class ColumnParallelLinear(nn.Linear):
    """`x @ W.T` for this rank's output rows: one `Split` per fused checkpoint block."""

    def __init__(self, in_features: int, splits: Sequence[Split], bias: bool) -> None:
        super().__init__(in_features, sum(s.length for s in splits), bias=bias)
        self.splits = list(splits)
        self.num_blocks = len(self.splits)  # checkpoint weights fused into each parameter

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_block(param, source, block, self.splits, dim=0)


class RowParallelLinear(nn.Linear):
    """`x @ W.T` over this rank's input columns, summed over the ranks (an all-reduce)."""

    def __init__(self, in_split: Split, out_features: int) -> None:
        super().__init__(in_split.length, out_features, bias=False)
        self.in_split, self.tp = in_split, current_group()

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_block(param, source, 0, [self.in_split], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = super().forward(x)  # this rank's columns' share: the ranks' shares add up
        return partial if self.tp.size == 1 else self.tp.all_reduce(partial)


class PackedMatmul(nn.Linear):
    """`x @ W.T + b`, `W` prepacked for oneDNN: the CPU's linear layers (`packed.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's block of ids; other ranks fill in the rest."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_group()
        self.first_id, rows = self.tp.vocab_shard(vocab_size)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        """This rank's rows of the vocabulary; the padding past its end stays zero."""
        real = max(0, min(param.shape[0], self.vocab_size - self.first_id))
        param.data[real:].zero_()
        copy_checked(param.data[:real], source[self.first_id : self.first_id + real])
        return param.data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        rows = input_ids - self.first_id
        mine = (rows >= 0) & (rows < self.weight.shape[0])
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce brings theirs.
        hidden = F.embedding(rows * mine, self.weight) * mine[:, None]
        return self.tp.all_reduce(hidden)


class ParallelLMHead(nn.Linear):
    """This rank's block of the vocabulary's logits (the embedding's rows);
    `join_vocabulary` brings the ranks' blocks together on rank 0."""

    def __init__(self, hidden_size: int, embedding: VocabParallelEmbedding) -> None:
        super().__init__(hidden_size, embedding.weight.shape[0], bias=False)
        self.load_block = embedding.load_block


def join_vocabulary(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor | None:
    """Every rank's block of the logits, `[S, rows]`, joined into `[S, vocab]` on rank 0;
    None on the other ranks, which never sample."""
    blocks = [torch.empty_like(local) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(local.contiguous(), blocks, dst=0)
    return torch.cat(blocks, dim=-1)[:, :vocab_size] if blocks else None


def attention_splits(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, list[Split], Split]:
    """This rank's query heads and KV heads, the q/k/v splits of the fused projection and
    the input split of `o_proj`. With fewer KV heads than ranks, consecutive ranks share a
    KV head: their query heads all belong to its group, so each keeps a copy."""
    tp = current_group()
    local_heads = num_heads // tp.size
    local_kv_heads = max(1, num_kv_heads // tp.size)
    first_kv_head = tp.rank * num_kv_heads // tp.size
    q = Split(tp.rank * local_heads * head_dim, local_heads * head_dim)
    kv = Split(first_kv_head * head_dim, local_kv_heads * head_dim)
    return local_heads, local_kv_heads, [q, kv, kv], q
