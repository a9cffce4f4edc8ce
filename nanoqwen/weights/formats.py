"""How a checkpoint stores its linear weights, and how small they are kept at run time.

* `PackedWeights`: a GPTQ or AWQ checkpoint's integer layout (`quantization_config`).
* `WeightQuantization`: linear weights kept as int8 or int4 in memory (`quantization.py`).
* `FourBitCodes`: a 4-bit GGUF tensor's own codes and group scales (`gguf.py`), which an
  int4 linear keeps as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


def is_gguf_file(path: str) -> bool:
    """Is `path` a llama.cpp GGUF file (which holds config, tokenizer and weights in one)?"""
    return path.endswith(".gguf") and os.path.isfile(path)


# GGML's 4- and 5-bit types give every 32 weights (a block or sub-block) their own scale.
GGUF_GROUP_SIZE = 32


@dataclass(frozen=True)
class WeightQuantization:
    """Linear weights kept as integers in memory and dequantized inside the matmul."""

    mode: str  # "int8": one scale per output row; "int4": a scale and zero per group
    group_size: int = 128  # int4: consecutive input channels that share a scale and zero


@dataclass(frozen=True)
class FourBitCodes:
    """A weight `[out, in]` stored as 4-bit codes with a scale and an offset per group of
    `GGUF_GROUP_SIZE` consecutive inputs: `w = code * scale + offset`, exactly.

    GGUF's Q4_0 (`offset = -8 * scale`), Q4_1 and Q4_K (a scale and a minimum per 32-value
    sub-block, themselves 6-bit multiples of the super-block's two float16 scales) all
    come to this.
    """

    codes: torch.Tensor  # int32 [out, in], each 0..15
    scales: torch.Tensor  # float32 [out, in // GGUF_GROUP_SIZE]
    offsets: torch.Tensor  # float32, like scales

    def weight(self) -> torch.Tensor:
        """The float32 weight `[out, in]` the codes stand for."""
        rows = self.codes.shape[0]
        groups = self.codes.view(rows, -1, GGUF_GROUP_SIZE).float()
        return groups.mul_(self.scales[..., None]).add_(self.offsets[..., None]).view(rows, -1)

    @classmethod
    def stacked(cls, parts: list[FourBitCodes]) -> FourBitCodes:
        """The parts' rows one after another, as a fused weight holds them."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            torch.cat([part.codes for part in parts]),
            torch.cat([part.scales for part in parts]),
            torch.cat([part.offsets for part in parts]),
        )


@dataclass(frozen=True)
class PackedWeights:
    """How a GPTQ or AWQ checkpoint packs its integer weights (`quantization_config`).

    Every quantized linear is stored as integer codes `qweight`, one zero point per group
    `qzeros` (both packed several to an int32), and one scale per group `scales`; the
    weight is `(code - zero) * scale`. `gptq_awq.py` unpacks them.
    """

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # input channels per group; -1: the whole row is one group
    zero_offset: int  # GPTQ's original format stores every zero point minus one

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any], source: str) -> PackedWeights:
        method = quantization_config.get("quant_method")
        bits = quantization_config.get("bits")
        group_size = quantization_config.get("group_size", 128)
        allowed_bits = {"gptq": (4, 8), "awq": (4,)}
        if method not in allowed_bits:
            raise ValueError(
                f"{source}: quantization method {method!r} is not supported; nanoqwen loads "
                "gptq and awq checkpoints and GGUF files"
            )
        if bits not in allowed_bits[method]:
            raise ValueError(f"{source}: {method} with {bits} bits is not supported")
        whole_rows = group_size == -1 and method == "gptq"
        if not isinstance(group_size, int) or not (group_size > 0 or whole_rows):
            raise ValueError(f"{source}: unsupported {method} group_size {group_size!r}")
        if method == "awq":
            version = str(quantization_config.get("version", "gemm")).lower()
            if version != "gemm" or not quantization_config.get("zero_point", True):
                raise ValueError(
                    f"{source}: only AWQ's GEMM layout with zero points is supported "
                    f"(this one is version {version!r})"
                )
            return cls("awq", bits, group_size, zero_offset=0)
        checkpoint_format = quantization_config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: unsupported GPTQ checkpoint_format {checkpoint_format!r}")
        return cls("gptq", bits, group_size, zero_offset=1 if checkpoint_format == "gptq" else 0)

    def runtime_quantization(self) -> WeightQuantization | None:
        return quantization_for_bits(self.bits, self.group_size if self.group_size > 0 else 128)


def quantization_for_bits(bits: int, group_size: int) -> WeightQuantization | None:
    """What keeps a checkpoint's `bits`-bit weights about as small in memory: int4 up to
    5 bits, int8 up to 8, and the dtype itself above that."""
    if bits <= 5:
        return WeightQuantization("int4", group_size)
    return WeightQuantization("int8") if bits <= 8 else None
