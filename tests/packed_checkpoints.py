"""GPTQ and AWQ checkpoints for tests, packed by hand from the formats' descriptions.

This is deliberately a second implementation, independent of `nanoqwen/gptq_awq.py`: it
quantizes with numpy and packs one field at a time with explicit shifts, the way the
formats are documented, so a mistake in either side's bit order shows as a mismatch.

* Quantization: groups of `group_size` input channels share, per output channel, a scale
  and an integer zero point; `code = round(w / scale) + zero`, clipped to `bits` bits.
  Symmetric quantization fixes the zero point at the middle code. With act-order the
  groups are runs of a random permutation of the input channels, and `g_idx` records
  each channel's group.
* GPTQ: `qweight[i, o]` holds the codes of input channels `i*k ... i*k+k-1` (k = 32/bits)
  of output `o`, lowest bits first; `qzeros[g, j]` holds the zero points of outputs
  `j*k ...` of group g, stored minus one in the original format (not in `gptq_v2`);
  `scales[g, o]` float16; `g_idx[i]` int32.
* AWQ (GEMM): `qweight[i, j]` holds input channel i's codes for outputs `j*8 ... j*8+7`,
  field f (bits 4f..4f+3) holding output `j*8 + [0, 2, 4, 6, 1, 3, 5, 7][f]`; `qzeros`
  the same way per group; `scales[g, o]` float16; zero points stored as they are.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field f of a word holds output AWQ_PACK_ORDER[f]


@dataclass(frozen=True)
class Layout:
    method: str  # "gptq" or "awq"
    bits: int = 4
    group_size: int = 128  # -1: one group per row (GPTQ)
    act_order: bool = False
    symmetric: bool = False
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" (zero points minus one) or "gptq_v2"

    def quantization_config(self) -> dict[str, Any]:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": self.symmetric,
                "checkpoint_format": self.checkpoint_format}


@dataclass
class QuantizedWeight:
    codes: np.ndarray  # [out, in] integers in [0, 2**bits)
    zeros: np.ndarray  # [groups, out] integers
    scales: np.ndarray  # [groups, out] float16
    groups: np.ndarray  # [in] the group of each input channel

    def dequantized(self) -> np.ndarray:
        zeros, scales = self.zeros[self.groups].T, self.scales[self.groups].T.astype(np.float32)
        return ((self.codes - zeros) * scales).astype(np.float32)

    def step(self) -> np.ndarray:
        """The quantization step (scale) of every weight, `[out, in]`."""
        return self.scales[self.groups].T.astype(np.float32)


def quantize(weight: np.ndarray, layout: Layout, rng: np.random.Generator) -> QuantizedWeight:
    out_features, in_features = weight.shape
    group_size = in_features if layout.group_size == -1 else layout.group_size
    order = rng.permutation(in_features) if layout.act_order else np.arange(in_features)
    groups = np.empty(in_features, dtype=np.int64)
    groups[order] = np.arange(in_features) // group_size
    max_code = 2**layout.bits - 1
    num_groups = in_features // group_size
    codes = np.empty(weight.shape, dtype=np.int64)
    zeros = np.empty((num_groups, out_features), dtype=np.int64)
    scales = np.empty((num_groups, out_features), dtype=np.float16)
    for group in range(num_groups):
        columns = np.flatnonzero(groups == group)
        w = weight[:, columns]
        low, high = np.minimum(w.min(1), 0), np.maximum(w.max(1), 0)
        if layout.symmetric:
            high = np.maximum(-low, high)
            low = -high
        scale = ((high - low) / max_code).astype(np.float16)
        zero = np.full(out_features, (max_code + 1) // 2) if layout.symmetric else np.round(-low / scale)
        codes[:, columns] = np.clip(np.round(w / scale[:, None]) + zero[:, None], 0, max_code)
        zeros[group], scales[group] = zero, scale
    return QuantizedWeight(codes, zeros, scales, groups)


def pack(quantized: QuantizedWeight, layout: Layout) -> dict[str, np.ndarray]:
    """The tensors a GPTQ or AWQ checkpoint stores for one linear layer."""
    if layout.method == "awq":
        return {
            "qweight": _pack_awq(quantized.codes.T),
            "qzeros": _pack_awq(quantized.zeros),
            "scales": quantized.scales,
        }
    stored_zeros = quantized.zeros - (1 if layout.checkpoint_format == "gptq" else 0)
    return {
        "qweight": _pack_gptq_rows(quantized.codes.T, layout.bits),
        "qzeros": _pack_gptq_rows(stored_zeros.T, layout.bits).T.copy(),
        "scales": quantized.scales,
        "g_idx": quantized.groups.astype(np.int32),
    }


def _pack_gptq_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack `values[r, c]` down the rows: row r goes to word row r // k, field r % k."""
    per_word = 32 // bits
    words = np.zeros((values.shape[0] // per_word, values.shape[1]), dtype=np.uint32)
    for row in range(values.shape[0]):
        field = (values[row] & (2**bits - 1)).astype(np.uint32)
        words[row // per_word] |= field << np.uint32(bits * (row % per_word))
    return words.view(np.int32)


def _pack_awq(values: np.ndarray) -> np.ndarray:
    """Pack `values[r, o]` (4-bit) along the outputs, in AWQ's interleaved field order."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for output in range(values.shape[1]):
        word, position = divmod(output, 8)
        field = AWQ_PACK_ORDER.index(position)
        words[:, word] |= values[:, output].astype(np.uint32) << np.uint32(4 * field)
    return words.view(np.int32)


def write_packed_checkpoint(
    model_dir: str, destination: Path, layout: Layout, seed: int = 0
) -> tuple[str, str]:
    """Quantize the decoder's linear layers of `model_dir` into `layout`.

    Writes `destination/packed`, the GPTQ/AWQ checkpoint, and `destination/dequantized`,
    the same model with every quantized weight replaced by its dequantized value: what the
    packed checkpoint must compute. Returns both directories.
    """
    packed_dir, dequantized_dir = destination / "packed", destination / "dequantized"
    for directory in (packed_dir, dequantized_dir):
        shutil.copytree(model_dir, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    rng = np.random.default_rng(seed)
    packed, dequantized = {}, {}
    tensors = load_file(Path(model_dir) / "model.safetensors")
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in QUANTIZED_LINEARS:
            packed[name] = dequantized[name] = tensor
            continue
        quantized = quantize(tensor, layout, rng)
        packed.update({f"{module}.{part}": value for part, value in pack(quantized, layout).items()})
        dequantized[name] = quantized.dequantized()
        if layout.method == "gptq" and f"{module}.bias" not in tensors:
            # GPTQ tools store a zero bias for every quantized layer, bias or not.
            packed[f"{module}.bias"] = np.zeros(tensor.shape[0], dtype=np.float16)
    save_file(packed, packed_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dequantized_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = layout.quantization_config()
    (packed_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(packed_dir), str(dequantized_dir)
