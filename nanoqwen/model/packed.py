"""Linear weights prepacked for oneDNN: bf16 matmuls on a CPU without a reorder per call.

oneDNN, the library behind torch's CPU matmuls, multiplies bf16 in a blocked weight layout
of its own (tiles sized to the AVX512-BF16 / AMX registers). Given a plain row-major weight,
`F.linear` has it reordered into that layout on every call, which at batch-1 decode costs
as much as the matrix-vector product itself. Reordering once after loading
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with the blocked copy
(`torch.ops.mkldnn._linear_pointwise`) gives the same bits, several times faster per call
at one row (docs/benchmarks.md has the figures and the command). vLLM's CPU build and
IPEX do the same.

This is one of the loader's weight forms (`weights/loader.py`): every linear layer of the
model becomes its packed twin, a subclass whose matmul reads the blocked weight, so a
row-parallel layer still adds up the ranks' partial sums after it.

Invariant: a packed layer's `weight` *is* the blocked tensor (an `mkldnn` tensor, which
only oneDNN's ops read), so the model holds each weight once, except one: an lm_head tied to
the embedding gets a packed copy of its own, since the embedding's lookup needs the plain
rows.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn


class PackedMatmul(nn.Linear):
    """`x @ W.T + b` with `W` in oneDNN's blocked layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@cache
def packed_twin(linear_class: type[nn.Linear]) -> type[nn.Linear]:
    """`linear_class` with its matmul on the packed weight (its own forward, if any, still
    runs around it: `super().forward` now reaches `PackedMatmul`)."""
    return type(f"Packed{linear_class.__name__}", (linear_class, PackedMatmul), {})


def pack_linear_weights(model: nn.Module, *unused: object) -> None:
    """Give every linear layer its oneDNN-blocked weight, in place (a weight form of the
    loader, for a full-precision bf16 model). A weight shared with another module (a tied
    lm_head) is copied: the other module keeps the plain one."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, PackedMatmul):
            # Blocked for 1 row (decode); measured as fast as any other for prefill too.
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.__class__ = packed_twin(type(module))
