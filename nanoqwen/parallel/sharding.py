"""Tensor parallelism: one model split across N ranks (GPUs, or CPU processes).

A model too big for one device, or one that should decode faster than one device can,
is cut into N slices that run at the same time, Megatron-style. Each decoder layer has
two places where a matmul's input or output can be split without any communication,
and one where the pieces must be joined:

* **Column-parallel** (`q/k/v`, `gate/up`): rank r keeps the output rows it is given,
  which means whole attention heads (and their q/k/v biases) and a slice of the MLP's
  intermediate channels. The input, the hidden state, is the same on every rank.
* **Row-parallel** (`o_proj`, `down_proj`): rank r keeps the input columns that match
  its heads or channels, so each rank computes a *partial sum* of the full output.
* **One all-reduce after each row-parallel matmul** adds the partial sums, and every
  rank again holds the same hidden state. That is two all-reduces per layer, the only
  communication inside a layer (`model.py`: `Attention.forward`, `MLP.forward`).

Attention needs no communication because heads are independent. A rank holds whole
query heads and the whole KV heads they read: with grouped-query attention and fewer
KV heads than ranks, a KV head is *replicated* on every rank whose query heads use it.
Per-head things are replicated too: the RMSNorm weights, including Qwen3's q/k norms,
which act on each head's `head_dim` channels alike.

The vocabulary is split by rows (padded to a multiple of N): the embedding looks up the
ids that fall in this rank's rows and an all-reduce fills in the rest; the lm_head
computes this rank's slice of the logits, and `gather_logits` joins the slices on
rank 0, where the requests, their penalties and their seeded generators live. Sampling
there, from the full row, with the code that samples a single-device model, is what
makes a seeded request draw the same tokens whatever the number of ranks.

`TensorParallel` is one rank's view: its rank, the number of ranks, which part of every
weight it reads (`read_shard`, straight from the safetensors file), and the
collectives (`torch.distributed`: gloo on the CPU, NCCL on GPUs). With one rank every
collective is a no-op, so the single-device model is the same code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanoqwen.model.config import ModelConfig

# How each of transformers' weights is split (by the name's part). Anything else (the
# RMSNorm weights, Qwen3's per-head q/k norms) is replicated.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # rows: weight and bias
ROW_PARALLEL = ("o_proj", "down_proj")  # columns
VOCAB_PARALLEL = ("embed_tokens", "lm_head")  # vocabulary rows, padded


class TensorSlice(Protocol):
    """A tensor in a file that reads only the part it is indexed with (safetensors'
    `safe_open(...).get_slice(name)`)."""

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """A ValueError unless `size` ranks can each hold whole heads and an equal MLP slice."""
    if size == 1:
        return
    name = f"tensor_parallel_size={size}"
    if config.num_heads % size:
        raise ValueError(f"{name} must divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"{name} must divide the model's {kv} key/value heads or be a multiple of them, "
            "so that every rank holds whole key/value heads"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"{name} must divide the model's intermediate_size={config.intermediate_size}"
        )


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    # ----------------------------------------------------------------- the split
    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """This rank's share of the decoder's shape: its query heads, its key/value heads
        (one, replicated, when there are fewer than ranks) and its MLP channels. The
        vocabulary keeps its full size: see `vocab_shard`."""
        if self.size == 1:
            return config
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=max(1, config.num_kv_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
        )

    def first_kv_head(self, num_kv_heads: int) -> int:
        """The first KV head this rank holds. With fewer KV heads than ranks, consecutive
        ranks share one: their query heads all belong to its group."""
        return self.rank * num_kv_heads // self.size

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's embedding and lm_head rows. Every rank has the
        same number of rows, the last padded with zeros, so the logits slices gather."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def read_shard(self, source: TensorSlice, name: str, config: ModelConfig) -> torch.Tensor:
        """This rank's part of transformers' weight `name`, reading nothing else."""
        part = next((p for p in COLUMN_PARALLEL + ROW_PARALLEL + VOCAB_PARALLEL
                     if f"{p}." in name), None)
        if part is None or self.size == 1:
            return source[:]
        start, length = self._range(part, config)
        dim = 1 if part in ROW_PARALLEL else 0
        shard = source[(slice(None),) * dim + (slice(start, start + length),)]
        if part in VOCAB_PARALLEL:
            _, rows = self.vocab_shard(config.vocab_size)
            shard = F.pad(shard, (0, 0, 0, rows - shard.shape[0]))
        return shard

    def _range(self, part: str, config: ModelConfig) -> tuple[int, int]:
        """(start, length) of this rank's rows or columns of a split weight."""
        local, head_dim = self.shard_config(config), config.head_dim
        if part in ("q_proj", "o_proj"):
            return self.rank * local.num_heads * head_dim, local.num_heads * head_dim
        if part in ("k_proj", "v_proj"):
            first = self.first_kv_head(config.num_kv_heads)
            return first * head_dim, local.num_kv_heads * head_dim
        if part in VOCAB_PARALLEL:
            start, rows = self.vocab_shard(config.vocab_size)
            return start, max(0, min(rows, config.vocab_size - start))
        size = local.intermediate_size  # gate_proj, up_proj, down_proj
        return self.rank * size, size

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place: partial sums become the full result."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's vocabulary slice, `[S, rows]`, joined on rank 0 into `[S, vocab]`;
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
