"""Keep linear weights as 8- or 4-bit integers in memory: weight-only quantization.

Decoding a token reads every weight of the model once, so the weights' size sets both the
memory a model needs and, on a GPU, how fast it decodes. Weight-only quantization stores
each linear layer's weight as small integer codes plus a few float scales, and leaves the
activations in floating point: the matmul kernel dequantizes the codes as it reads them.

* **int8**: one scale per output row, `w ≈ code * scale`, a quarter of float32's bytes.
* **int4**: a scale and a zero point per group of `group_size` input channels,
  `w ≈ (code - 8) * scale + zero`: an eighth of float32's bytes, plus the groups' scales.

torchao does the work on a GPU, and for int4: `quantize_` swaps a layer's weight for a
tensor subclass holding the codes and scales, whose matmul calls a kernel for them. Only the
decoder's linear layers are quantized there; the embedding and the lm_head stay in the
model's dtype, as GPTQ and AWQ checkpoints keep them. Kernels exist (torchao 0.18, torch
2.13) for

* int8 on any device and dtype (the codes are converted to the dtype per matmul);
* int4 in bfloat16 only: `_weight_int4pack_mm_for_cpu` on the CPU, tinygemm on CUDA.
  The CPU kernel accepts float32 and float16 too, but runs them 15-80x slower than a
  dense float32 matmul, so we treat it as missing there.

**int8 on a CPU** is `Int8Linear` instead: torch's own int8 kernel
(`_weight_int8pack_mm`), fed bfloat16 activations (it is fast for those alone), and the
lm_head too, since at batch 1 the vocabulary projection is a large share of what a token
reads. torchao's int8 tensor reaches that kernel only after slower paths, several times
slower for one token (docs/quantization.md has the figures and the commands).

**int4 of a GGUF file on a CPU** is `Int4Linear`: the kernel's `(code - 8) * scale + zero`
can hold GGUF's 4-bit types (Q4_0, Q4_1, Q4_K: `code * scale + offset` per 32 weights)
with the file's own codes, so nothing is rounded again but the scales, to bfloat16. The
file's tensors of other types (Q5_K, Q6_K, Q8_0, ...) become `Int8Linear`s, and the
embedding an `Int8Embedding` whose codes a tied lm_head shares (`gguf_codes.py` builds
them all as the file is read).

Where no kernel fits, the weights stay dequantized in the model's dtype, with one warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from nanoqwen.weights.formats import GGUF_GROUP_SIZE, FourBitCodes, WeightQuantization

logger = logging.getLogger(__name__)

# int4 group sizes every int4 kernel above takes, largest (fewest scales) first.
INT4_GROUP_SIZES = (128, 64, 32)
# torch's CPU int4 packing takes weights of a multiple of this many output rows.
INT4_CPU_ROWS = 16
# What importing torchao logs that says nothing a user can act on, by logger: a warning for
# each optional CUDA extension a CPU build of torch cannot load, and torch's notice that
# torchao registers its enums in a way torch has deprecated. The weight-only paths used
# here need none of those extensions.
TORCHAO_IMPORT_NOISE = {
    "torchao": re.compile(r"^Failed to load \S*_C_\w*[.\w-]*\.so\b"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
}


def keep_quantized(
    model: nn.Module, checkpoint: object, num_blocks: object, scheme: WeightQuantization
) -> None:
    """The loader's "int8" and "int4" weight forms: `quantize_linears`."""
    quantize_linears(model, scheme)


def quantize_linears(model: nn.Module, scheme: WeightQuantization) -> None:
    """Keep the decoder's linear layers quantized, in place: as `Int8Linear`s for int8 on a
    CPU (the lm_head too), else their weights as torchao's quantized tensors."""
    linears = [module for module in model.model.layers.modules() if isinstance(module, nn.Linear)]
    weight = model.model.embed_tokens.weight  # in the dtype and on the device of the model
    if scheme.mode == "int8" and weight.device.type == "cpu":
        swap_modules(model, lambda module: isinstance(module, nn.Linear), Int8Linear)
        return
    in_features = [linear.in_features for linear in linears]
    config, reason = torchao_config(scheme, in_features, weight.device, weight.dtype)
    if config is None:
        logger.warning("%s; keeping the linear weights in %s", reason, _dtype_name(weight.dtype))
        return
    with _quiet_torchao_import():
        from torchao.quantization import quantize_
    failures: list[str] = []
    for linear in linears:
        dense = linear.weight
        try:
            quantize_(linear, config)
            # Quantizing can succeed where the matmul kernel is missing: run it once.
            with torch.inference_mode():
                linear(torch.ones(1, linear.in_features, dtype=dense.dtype, device=dense.device))
        except Exception as error:  # torchao reports a missing kernel in many ways
            linear.weight = dense
            failures.append(f"{type(error).__name__}: {error}")
    if failures:
        logger.warning(
            "%s weight-only quantization failed for %d of %d linear layers (%s); they keep %s "
            "weights",
            scheme.mode, len(failures), len(linears), failures[0], _dtype_name(weight.dtype),
        )


def torchao_config(
    scheme: WeightQuantization, in_features: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[Any, str]:
    """torchao's config for `scheme` on this device and dtype, or None and the reason why not."""
    with _quiet_torchao_import():
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    if scheme.mode == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False), ""
    if dtype != torch.bfloat16:
        return None, (
            f"int4 weight-only matmuls are fast only in bfloat16, not {_dtype_name(dtype)} "
            "(run in bfloat16: dtype='bfloat16', or --dtype bf16 on the command line)"
        )
    group_size = int4_group_size(scheme.group_size, in_features)
    if group_size is None:
        return None, (
            f"no int4 group size of {INT4_GROUP_SIZES} divides every layer's inputs "
            f"{sorted(set(in_features))}"
        )
    if device.type == "cuda":
        return Int4WeightOnlyConfig(
            group_size=group_size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        ), ""
    return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False), ""


class BFloat16KernelLinear(nn.Module):
    """A linear layer whose weight a CPU kernel multiplies from its integer codes, fed
    bfloat16 rows (the kernels are fast for those alone); the result in the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = self.multiply(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows @ weight.T`, bfloat16 `[n, in_features]` to `[n, out_features]`."""
        raise NotImplementedError


class Int8Linear(BFloat16KernelLinear):
    """A linear layer kept as int8 codes with one scale per output row, `w ≈ code * scale`
    (`_weight_int8pack_mm`)."""

    def __init__(self, linear: nn.Linear, rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The codes and scales of `linear`'s weight, or `rows` (another module's, shared)."""
        super().__init__(linear)
        codes, scales = int8_rows(linear.weight) if rows is None else rows
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)

    def dequantized(self) -> torch.Tensor:
        """The weight these codes stand for, `[out_features, in_features]`, in float32."""
        return self.codes.float() * self.scales.float()[:, None]


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's int8 codes and its rows' bfloat16 scales, `w ≈ code * scale`: each row's
    largest magnitude is code 127."""
    weight = weight.detach().float()
    low, high = torch.aminmax(weight, dim=1)  # no |weight| temporary: a row's extremes
    scales = torch.maximum(-low, high).clamp_(min=torch.finfo(torch.float32).tiny) / 127
    codes = torch.div(weight, scales[:, None]).round_().to(torch.int8)
    return codes, scales.to(torch.bfloat16)


class Int8Embedding(nn.Module):
    """An embedding kept as int8 rows (`int8_rows`), each looked up and scaled into `dtype`.
    A tied lm_head multiplies by the same codes (`Int8Linear(lm_head, rows)`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[input_ids].float() * self.scales[input_ids, None].float()
        return rows.to(self.dtype)


class Int4Linear(BFloat16KernelLinear):
    """A linear layer kept as a GGUF file's own 4-bit codes, with a scale and a zero per
    group of 32 inputs: `w = (code - 8) * scale + zero` (`_weight_int4pack_mm_for_cpu`).

    The file's weight is `code * scale + offset` (`FourBitCodes`), so `zero = offset + 8 *
    scale` gives it back with the same codes; only the scale and the zero are rounded, to
    bfloat16, the kernel's type for them: a weight is off by its group's scale error
    times `code - 8` (at most 8) plus the zero's error, a few hundredths of a code step.
    """

    def __init__(self, linear: nn.Linear, weight: FourBitCodes) -> None:
        super().__init__(linear)
        scales = weight.scales.to(torch.bfloat16)
        zeros = (weight.offsets + 8 * weight.scales).to(torch.bfloat16)
        codes = weight.codes.to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.register_buffer("packed", packed)
        # [groups, out_features, 2]: the kernel's layout.
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, GGUF_GROUP_SIZE, self.scales_and_zeros
        )


def swap_modules(
    model: nn.Module, wanted: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]
) -> None:
    """Replace every submodule `wanted` says yes to by `make(it)`, in place."""
    for name, module in list(model.named_modules()):
        if name and wanted(module):
            replace_module(model, name, make(module))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, new)


def int4_group_size(requested: int, in_features: list[int]) -> int | None:
    """The largest supported group size, at most `requested`, that divides every layer's inputs."""
    for size in INT4_GROUP_SIZES:
        if size <= requested and all(features % size == 0 for features in in_features):
            return size
    return None


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters (a tied weight once, quantized ones as their
    codes plus scales and zero points) and by the codes and scales of `Int8Linear`s,
    `Int4Linear`s and an `Int8Embedding`."""
    codes = {
        id(tensor): tensor  # a tied lm_head's codes are its embedding's: once
        for module in model.modules()
        if isinstance(module, (BFloat16KernelLinear, Int8Embedding))
        for tensor in module.buffers(recurse=False)
    }
    return sum(tensor_bytes(tensor) for tensor in (*model.parameters(), *codes.values()))


def tensor_bytes(tensor: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(tensor):  # torchao's quantized tensors
        inner_names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in inner_names)
    return tensor.numel() * tensor.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DropMatching(logging.Filter):
    """Drops the records of a logger whose message matches `pattern`; the rest pass."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def torchao_import_noise() -> list[tuple[logging.Logger, DropMatching]]:
    """A filter for each logger of `TORCHAO_IMPORT_NOISE`, to add to it."""
    return [
        (logging.getLogger(name), DropMatching(pattern))
        for name, pattern in TORCHAO_IMPORT_NOISE.items()
    ]


@contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """Import torchao without `TORCHAO_IMPORT_NOISE` (the command lines drop it for good,
    as another library's import of torchao sends it too)."""
    filters = torchao_import_noise()
    for each, drop in filters:
        each.addFilter(drop)
    try:
        yield
    finally:
        for each, drop in filters:
            each.removeFilter(drop)
