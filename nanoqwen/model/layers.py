"""The decoder's building blocks: RMSNorm, and linear layers that may be split across ranks.

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

With one rank every split is the whole weight and every collective a no-op. Each split
parameter is loaded by its layer's `load_block`, which reads only its slice of the
checkpoint tensor, so no rank ever holds a full weight it does not keep.

Invariant: the ranks' slices of a weight cover it exactly (KV heads fewer than the ranks
are replicated), and after every all-reduce all ranks hold the same hidden state. The
story, with a picture: docs/learn/11-tensor-parallelism.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoqwen.model.packed import PackableLinear


class TensorSlice(Protocol):
    """A checkpoint tensor that reads only the part it is indexed with (safetensors'
    `get_slice(name)`; a plain tensor works too)."""

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of the split: its rank, the number of ranks, and the collectives
    (`torch.distributed`: gloo on the CPU, NCCL on GPUs), each a no-op with one rank."""

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

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's vocabulary block, `[S, rows]`, joined on rank 0 into `[S, vocab]`;
        None on the other ranks, which never sample."""
        if self.size == 1:
            return local
        if local.shape[0] == 0:  # nothing sampled this step, on any rank
            return local.new_empty(0, vocab_size) if self.rank == 0 else None
        slices = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), slices, dst=0)
        return torch.cat(slices, dim=-1)[:, :vocab_size] if slices else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of any rank: what every rank can afford (a KV page count)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


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


def add_up_partial_sums(partial: torch.Tensor, group: TensorParallel) -> torch.Tensor:
    """Sum over `group`'s ranks, in place, the partial outputs of a layer that ends like a
    `RowParallelLinear` without being one (the MoE block: experts and shared expert add
    their partial sums first, then the ranks add theirs once)."""
    return group.all_reduce(partial)


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


@dataclass(frozen=True)
class Split:
    """Which part of one checkpoint weight a rank keeps: `length` rows (or columns) from
    `start`, out of `total`."""

    start: int
    length: int

    @staticmethod
    def even(total: int) -> Split:
        """An equal share of `total` for this rank (the split was checked to divide)."""
        tp = current_group()
        length = total // tp.size
        return Split(tp.rank * length, length)


def read_block(
    param: torch.Tensor, source: TensorSlice, block: int, splits: Sequence[Split], dim: int
) -> torch.Tensor:
    """Copy this rank's part of checkpoint block `block` (its `splits[block]` along `dim`)
    into the parameter's rows for that block; return the rows written."""
    split = splits[block]
    offset = sum(s.length for s in splits[:block]) if dim == 0 else 0
    index = (slice(None),) * dim + (slice(split.start, split.start + split.length),)
    target = param.data.narrow(dim, offset, split.length) if dim == 0 else param.data
    copy_checked(target, source[index])
    return target


def copy_checked(target: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ShapeMismatch(tuple(tensor.shape), tuple(target.shape))
    target.copy_(tensor)


class ShapeMismatch(ValueError):
    def __init__(self, checkpoint: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"checkpoint has {checkpoint}, model expects {expected}")


def load_whole(param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
    """How a parameter every rank keeps whole (a norm's) is loaded."""
    copy_checked(param.data, source[:])
    return param.data


class ColumnParallelLinear(PackableLinear):
    """`x @ W.T` for this rank's output rows: one `Split` per fused checkpoint block."""

    def __init__(self, in_features: int, splits: Sequence[Split], bias: bool) -> None:
        super().__init__(in_features, sum(s.length for s in splits), bias=bias)
        self.splits = list(splits)
        self.num_blocks = len(self.splits)  # checkpoint weights fused into each parameter

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_block(param, source, block, self.splits, dim=0)


class RowParallelLinear(PackableLinear):
    """`x @ W.T` over this rank's input columns, summed over the ranks (an all-reduce)."""

    def __init__(self, in_split: Split, out_features: int) -> None:
        super().__init__(in_split.length, out_features, bias=False)
        self.in_split, self.tp = in_split, current_group()

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_block(param, source, 0, [self.in_split], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each rank's columns give a partial sum of the output; add them up.
        return self.tp.all_reduce(super().forward(x))


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


class ParallelLMHead(PackableLinear):
    """This rank's block of the vocabulary's logits (the same rows as the embedding's)."""

    def __init__(self, hidden_size: int, embedding: VocabParallelEmbedding) -> None:
        super().__init__(hidden_size, embedding.weight.shape[0], bias=False)
        self.load_block = embedding.load_block


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


def check_splittable_shape(
    num_heads: int, num_kv_heads: int, intermediate_size: int, size: int
) -> None:
    """A ValueError unless `size` ranks can each hold whole heads and an equal MLP slice."""
    if size == 1:
        return
    name = f"tensor_parallel_size={size}"
    if num_heads % size:
        raise ValueError(f"{name} must divide the model's {num_heads} attention heads")
    kv = num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"{name} must divide the model's {kv} key/value heads or be a multiple of them, "
            "so that every rank holds whole key/value heads"
        )
    if intermediate_size % size:
        raise ValueError(f"{name} must divide the model's intermediate_size={intermediate_size}")
