"""Filling a parameter from a checkpoint tensor: the part of it this rank keeps.

The loader (`weights/loader.py`) hands every parameter the checkpoint tensors that belong to
it, one at a time, to its module's `load_block(param, source, block)`: `block` says which of
the checkpoint weights fused into the parameter it is (q, k or v of `qkv_proj`; an expert's
gate or up rows), and `source` reads only what it is indexed with (a view of the
memory-mapped checkpoint file), so a rank of a split model reads just its slice. These are
the pieces every `load_block` is made of. Invariant: every row of a parameter is written by
exactly one block, or loading fails naming the weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class TensorSlice(Protocol):
    """A checkpoint tensor that reads only the part it is indexed with: a tensor viewing the
    mapped file (`weights/loader.py`), or anything indexed like one."""

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


class Span(Protocol):
    """Rows (or columns) `start, ..., start + length - 1` of a weight (`layers.Split`)."""

    start: int
    length: int


def read_block(
    param: torch.Tensor, source: TensorSlice, block: int, splits: Sequence[Span], dim: int
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
