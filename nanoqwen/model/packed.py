"""Linear weights prepacked for oneDNN: CPU matmuls without a reorder per call.

oneDNN, one of the libraries behind torch's CPU matmuls, multiplies in a blocked weight layout
of its own (tiles sized to the vector registers). Reordering a plain row-major weight into that
layout once, after loading (`torch.ops.mkldnn._reorder_linear_weight`), and multiplying with
the blocked copy (`torch.ops.mkldnn._linear_pointwise`) pays in both dtypes the engine runs
on a CPU:

* bf16: `F.linear` has oneDNN reorder the weight on every call, which at batch-1 decode
  costs as much as the product itself; the packed matmul gives the same bits, several times
  faster at one row.
* float32: `F.linear` calls the BLAS torch was built with, whose product at the few rows of
  a decode step is slower than oneDNN's kernel on the blocked weight (about 1.5-3x for the
  0.6B model's layers and lm_head at 16 rows on an AVX2 CPU; on a par at prefill sizes).
  The sums run in another order, so results differ from `F.linear` within float32 rounding.

docs/benchmarks.md has the figures and the commands. vLLM's CPU build and IPEX do the same.

This is one of the loader's weight forms (`weights/loader.py`): every linear layer of the
model becomes its packed twin, a subclass whose matmul is `layers.py`'s `PackedMatmul`, so
a row-parallel layer still adds up the ranks' partial sums after it.

Invariant: a packed layer's `weight` *is* the blocked tensor (an `mkldnn` tensor, which
only oneDNN's ops read), so the model holds each weight once, except one: an lm_head tied to
the embedding gets a packed copy of its own, since the embedding's lookup needs the plain
rows.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from nanoqwen.model.layers import PackedMatmul


@cache
def packed_twin(linear_class: type[nn.Linear]) -> type[nn.Linear]:
    """`linear_class` with its matmul on the packed weight (its own forward, if any, still
    runs around it: `super().forward` now reaches `PackedMatmul`)."""
    if linear_class is nn.Linear:  # nothing of its own to keep
        return PackedMatmul
    return type(f"Packed{linear_class.__name__}", (linear_class, PackedMatmul), {})


def pack_linear_weights(model: nn.Module, *unused: object) -> None:
    """Give every linear layer its oneDNN-blocked weight, in place (a weight form of the
    loader, for a full-precision float32 or bf16 model). A weight shared with another module
    (a tied lm_head) is copied: the other module keeps the plain one."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, PackedMatmul):
            hint = rows_hint(module.weight.dtype)  # no local keeps the plain weight alive
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), hint)
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.__class__ = packed_twin(type(module))


def rows_hint(dtype: torch.dtype) -> int:
    """The batch oneDNN blocks a weight for (any batch still multiplies). bf16: one row,
    measured as fast as any other at prefill too. float32: 16 rows, a served decode step's
    (a 0.6B model's step at 16 rows 11% faster than blocked for one, at one row 4% slower:
    docs/benchmarks.md)."""
    return 1 if dtype == torch.bfloat16 else 16
