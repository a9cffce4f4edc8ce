"""Linear weights prepacked for oneDNN: bf16 matmuls on a CPU without a reorder per call.

oneDNN, the library behind torch's CPU matmuls, multiplies bf16 in a blocked weight layout
of its own (tiles sized to the AVX512-BF16 / AMX registers). Given a plain row-major weight,
`F.linear` has it reordered into that layout on every call, which at batch-1 decode costs
as much as the matrix-vector product itself. Reordering once after loading
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with the blocked copy
(`torch.ops.mkldnn._linear_pointwise`) gives the same bits and, on 2 cores of an AVX512-BF16
CPU, per call: 1536 x 8960 (`down_proj`) 1.23 -> 0.28 ms at 1 row and 2.0 -> 1.1 ms at
16; 17920 x 1536 (`gate_up_proj`) 2.6 -> 1.6 ms; the lm_head 23.7 -> 17.1 ms; prefill
(128 to 512 rows) the same or a few percent faster. vLLM's CPU build and IPEX do the same.

Invariant: a packed layer's `weight` *is* the blocked tensor (an `mkldnn` tensor, which
only oneDNN's ops read), so the model holds each weight once, except one: an lm_head tied to
the embedding gets a packed copy of its own, since the embedding's lookup needs the plain
rows. That is 467 MB more for Qwen2.5-1.5B, for 6-12 ms less per decoded token (the
largest single matmul of a step, 29 ms plain in the model, 17-18 ms packed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.config import cpu_has_native_bf16


class PackableLinear(nn.Linear):
    """`nn.Linear` whose weight may be oneDNN's blocked copy (see `pack_linear_weights`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packs_linear_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Only bf16 on a CPU that multiplies it in hardware: elsewhere oneDNN's bf16 path
    would emulate, and float32 has no prepacked path here that beats `F.linear`."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and cpu_has_native_bf16()
    )


def pack_linear_weights(model: nn.Module) -> None:
    """Replace every `PackableLinear`'s weight by its oneDNN-blocked copy, in place (for a
    full-precision bf16 model: quantized layers have kernels of their own). A weight shared
    with another module (a tied lm_head) is copied: the other module keeps the plain one."""
    for module in model.modules():
        if isinstance(module, PackableLinear) and not module.weight.is_mkldnn:
            # Blocked for 1 row (decode); measured as fast as any other for prefill too.
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.weight = nn.Parameter(packed, requires_grad=False)
