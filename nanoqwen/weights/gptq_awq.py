"""Unpack GPTQ and AWQ checkpoints: integer weight codes packed eight (or four) to an int32.

Both formats store a quantized linear `[out, in]` as three or four tensors:

* `qweight`, the integer codes, `bits` each, packed into int32 words;
* `qzeros`, one zero point per (group, output channel), packed the same way;
* `scales`, one float16 scale per (group, output channel);
* (GPTQ only) `g_idx`, the group of every input channel.

and the weight is `(code - zero) * scale`, with a group's zero and scale shared by
`group_size` input channels. Where they differ is the packing:

* **GPTQ** packs `qweight` down the input dimension: word `[i, o]` holds the codes of input
  channels `i * 32/bits ...` of output `o`, lowest bits first. `qzeros` is packed along
  the output dimension. The original format stores every zero point minus one, a quirk
  the `gptq_v2` format dropped. With act-order (`desc_act`), GPTQ quantized the input
  channels in order of importance, so groups are not runs of consecutive channels:
  `g_idx` names each channel's group.
* **AWQ** (GEMM layout) packs `qweight` `[in, out/8]` and `qzeros` along the output
  dimension, in an interleaved order: the eight 4-bit fields of a word, lowest first,
  hold output channels 0, 2, 4, 6, 1, 3, 5, 7 of its block of eight (what its kernel
  reads fastest). Groups are runs of consecutive input channels.

We unpack to ordinary float weights at load time; `quantization.py` then keeps them small
in memory with torchao's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from nanoqwen.weights.formats import PackedWeights

PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
# Which 4-bit field of an AWQ word holds output channel 0, 1, ..., 7 of its block of eight.
AWQ_FIELD_OF_CHANNEL = [0, 4, 1, 5, 2, 6, 3, 7]


def unpack_checkpoint(
    names: Iterable[str], read: Callable[[str], torch.Tensor], packed: PackedWeights
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint's tensors, each packed linear as one float32 `<module>.weight`."""
    names = list(names)
    present = set(names)
    for name in names:
        module, _, part = name.rpartition(".")
        if part == "qweight":
            parts = {}
            for part in PACKED_PARTS:
                if f"{module}.{part}" in present:
                    parts[part] = read(f"{module}.{part}")
                elif part in ("qzeros", "scales"):
                    raise ValueError(f"missing weight '{module}.{part}' of a {packed.method} layer")
            yield f"{module}.weight", dequantize(parts, packed)
        elif part not in PACKED_PARTS or f"{module}.qweight" not in present:
            yield name, read(name)


def dequantize(parts: dict[str, torch.Tensor], packed: PackedWeights) -> torch.Tensor:
    """One linear's weight `[out, in]` in float32 from its packed parts."""
    scales = parts["scales"].float()  # [groups, out]
    if packed.method == "awq":
        codes = unpack_awq(parts["qweight"], packed.bits)  # [in, out]
        zeros = unpack_awq(parts["qzeros"], packed.bits)  # [groups, out]
    else:
        codes = unpack(parts["qweight"], packed.bits, dim=0)
        zeros = unpack(parts["qzeros"], packed.bits, dim=1) + packed.zero_offset
    in_features = codes.shape[0]
    group = parts.get("g_idx")
    if group is None:
        group_size = packed.group_size if packed.group_size > 0 else in_features
        group = torch.arange(in_features) // group_size
    group = group.long()
    consistent = (
        group.shape == (in_features,)
        and int(group.max()) < scales.shape[0]
        and zeros.shape == scales.shape
        and codes.shape[1] == scales.shape[1]
    )
    if not consistent:
        raise ValueError(
            f"inconsistent {packed.method} tensors: qweight unpacks to {tuple(codes.shape)}, "
            f"qzeros to {tuple(zeros.shape)}, scales are {tuple(scales.shape)}"
        )
    return ((codes - zeros[group]) * scales[group]).t().contiguous()


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words → their `32 / bits` unsigned fields, lowest first, spread along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # Shifting a negative word drags its sign bit in from the top; the mask drops it.
    fields = (packed.int().unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, fields]
    if dim == 0:
        fields = fields.transpose(1, 2)  # a word's fields are consecutive rows
    return fields.flatten(dim, dim + 1).float()


def unpack_awq(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """AWQ's words `[rows, out / 8]` → codes `[rows, out]` in output-channel order."""
    fields = unpack(packed, bits, dim=1).view(packed.shape[0], -1, 32 // bits)
    return fields[:, :, AWQ_FIELD_OF_CHANNEL].flatten(1)
