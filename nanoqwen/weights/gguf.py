"""Read a llama.cpp GGUF file: one file holding the config, the tokenizer and the weights.

A GGUF file has no `config.json` or `tokenizer.json`. Its metadata is a flat key-value map
under llama.cpp's names (`qwen2.block_count`, `tokenizer.ggml.merges`, ...), and each tensor
is stored under llama.cpp's name (`blk.0.attn_q.weight`) in a type of its own: F32, F16 or
BF16, or a block quantization such as Q8_0 (32 int8 codes and one scale) or the k-quants
Q4_K/Q5_K/Q6_K (256-value super-blocks of 16- or 32-value sub-blocks, each with its own
scale). A "Q4_K_M" file mixes several of these.

Libraries do the reading: transformers turns the metadata into a config and a tokenizer
with its chat template (`AutoConfig/AutoTokenizer.from_pretrained(dir, gguf_file=name)`),
and the `gguf` package maps tensor names and dequantizes every type to float32. What is
left to us is small: naming each tensor as transformers does, so the loader can fuse it
like any checkpoint, and the facts transformers does not read from a Qwen file (head_dim,
rope scaling, and a mixture of experts' widths and routing). llama.cpp permutes the q/k
rows of Llama checkpoints for its rotary kernel, but writes Qwen2/Qwen3 unpermuted, so no
rows need undoing here.

A Qwen2-MoE or Qwen3-MoE file (`qwen2moe`, `qwen3moe`) keeps each layer's experts stacked,
one tensor per part (`blk.N.ffn_gate_exps.weight` `[E, rows, cols]`, the router in
`ffn_gate_inp`, the shared expert in `ffn_*_shexp`); the loader cuts the stacks per expert
(`model/moe.py`). The hybrid models' files (`qwen3next`, `qwen35`, `qwen35moe`) are refused.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import gguf
import numpy as np
import numpy.typing as npt
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from nanoqwen.weights.formats import FourBitCodes, is_gguf_file

# The 4-bit types, by where a block's codes start and how many bytes a run of them takes.
FOUR_BIT_TYPES = {
    gguf.GGMLQuantizationType.Q4_0: (2, 16),
    gguf.GGMLQuantizationType.Q4_1: (4, 16),
    gguf.GGMLQuantizationType.Q4_K: (16, 32),
}
# Rows numpy dequantizes at a time: enough to spread its per-call cost, its temporaries cached.
ROWS_PER_DEQUANTIZE = 256
# llama.cpp's architecture name → (gguf's enum for its tensor names, transformers' class).
ARCHITECTURES = {
    "qwen2": (gguf.MODEL_ARCH.QWEN2, "Qwen2ForCausalLM"),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, "Qwen3ForCausalLM"),
    "qwen2moe": (gguf.MODEL_ARCH.QWEN2MOE, "Qwen2MoeForCausalLM"),
    "qwen3moe": (gguf.MODEL_ARCH.QWEN3MOE, "Qwen3MoeForCausalLM"),
}
# The hybrid decoders' files, which nanoqwen does not read: llama.cpp's converter reorders
# and transforms their linear-attention tensors, and transformers reads neither their
# config nor their tokenizer from a GGUF file.
HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
# llama.cpp renormalises a Qwen3-MoE token's k routing weights to sum to 1, and a
# Qwen2-MoE's not, unless the file says otherwise (`expert_weights_norm`).
RENORMALISES_TOP_K = {"qwen2moe": False, "qwen3moe": True}


def from_pretrained_arguments(path: str) -> tuple[str, dict[str, str]]:
    """What transformers' `from_pretrained` takes to read `path`: a checkpoint directory as
    it is, a GGUF file as its directory and `gguf_file=` its name."""
    if not is_gguf_file(path):
        return path, {}
    directory, name = os.path.split(os.path.abspath(path))
    return directory, {"gguf_file": name}


def read_gguf_config(path: str) -> tuple[PretrainedConfig, int]:
    """The transformers config of a GGUF file, and how many bits its linear weights mostly have."""
    reader = open_gguf(path)
    architecture = gguf_architecture(reader, path)
    directory, gguf_file = from_pretrained_arguments(path)
    try:
        with transformers_reading_plainly():
            hf = AutoConfig.from_pretrained(directory, **gguf_file)
    except Exception as error:  # transformers raises many kinds on odd metadata
        message = f"{path}: could not read the model config from its metadata: {error}"
        raise ValueError(message) from error
    hf.architectures = [ARCHITECTURES[architecture][1]]
    # transformers counts the vocabulary's tokens, left unread: the embedding has a row each.
    hf.vocab_size = vocabulary_size(reader, path)
    if architecture in RENORMALISES_TOP_K:
        read_expert_sizes(hf, reader, architecture)
    # transformers leaves a Qwen3 file at Qwen3Config's default head_dim (128); the file says.
    key_length = metadata(reader, f"{architecture}.attention.key_length")
    if key_length is not None:
        hf.head_dim = key_length
    scaling = metadata(reader, f"{architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
        hf.rope_parameters = {**hf.rope_parameters, "rope_type": scaling,
                              "factor": metadata(reader, f"{architecture}.rope.scaling.factor")}
        original = metadata(reader, f"{architecture}.rope.scaling.original_context_length")
        if original is not None:
            hf.rope_parameters["original_max_position_embeddings"] = original
    return hf, linear_weight_bits(reader)


def vocabulary_size(reader: gguf.GGUFReader, path: str) -> int:
    """Rows of the file's embedding (GGUF lists a matrix's shape innermost first)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError(f"{path}: the file has no token embedding (token_embd.weight)")


def read_expert_sizes(hf: PretrainedConfig, reader: gguf.GGUFReader, architecture: str) -> None:
    """What transformers leaves at its config's defaults in a MoE file: each expert's width,
    the shared expert's (Qwen2-MoE) and whether the routing weights are renormalised."""
    hf.moe_intermediate_size = metadata(reader, f"{architecture}.expert_feed_forward_length")
    shared = metadata(reader, f"{architecture}.expert_shared_feed_forward_length")
    if architecture == "qwen2moe":
        hf.shared_expert_intermediate_size = shared or 0
    renormalise = metadata(reader, f"{architecture}.expert_weights_norm")
    hf.norm_topk_prob = RENORMALISES_TOP_K[architecture] if renormalise is None else renormalise


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer and chat template stored in a GGUF file's metadata."""
    gguf_architecture(open_gguf(path), path)
    directory, gguf_file = from_pretrained_arguments(path)
    try:
        with transformers_reading_plainly():
            return AutoTokenizer.from_pretrained(directory, **gguf_file)
    except Exception as error:  # transformers raises many kinds on odd metadata
        message = f"{path}: could not build the tokenizer from its metadata: {error}"
        raise ValueError(message) from error


def iter_gguf_tensors(
    path: str, checkpoint_names: Iterable[str], num_layers: int
) -> Iterator[tuple[str, FileTensor]]:
    """Yield (name, tensor) for every tensor of the file, one at a time, each read from the
    file only where it is indexed (`FileTensor`).

    Tensors come named as `checkpoint_names` (transformers' names, e.g.
    `model.layers.0.self_attn.q_proj.weight`) when one of them maps to the tensor's GGUF
    name, and under their GGUF name otherwise, for the loader to reject as unexpected.
    Once the loader asks for the next tensor, the pages of the last one's memory map are
    dropped: the file, read once, does not stay in the process's memory.
    """
    reader = open_gguf(path)
    for name, tensor in named_tensors(reader, path, checkpoint_names, num_layers):
        yield name, FileTensor(tensor, path)
        reader.drop_pages(tensor)


class FileTensor:
    """A tensor of the file that reads, and dequantizes to float32, only the rows it is
    indexed with, as a safetensors slice does (`model.loading.TensorSlice`): a block
    quantization packs each row into whole blocks, so rows can be read on their own."""

    def __init__(self, tensor: gguf.ReaderTensor, path: str) -> None:
        self.tensor, self.path = tensor, path
        # `data`'s last axis is a row's bytes (or values, for F32/F16/BF16).
        self.shape = (*tensor.data.shape[:-1], int(tensor.shape[0]))

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows, columns = index[: len(self.shape) - 1], index[len(self.shape) - 1 :]
        values = dequantize(self.tensor.tensor_type, self.tensor.data[rows], self.tensor.name, self.path)
        return values[(..., *columns)] if columns else values

    def four_bit_codes(self) -> FourBitCodes | None:
        """The file's own codes of a matrix stored in a 4-bit type, else None (the experts'
        3-D stacks too: they keep their dequantized weights)."""
        if self.tensor.tensor_type in FOUR_BIT_TYPES and len(self.shape) == 2:
            return four_bit_codes(self.tensor)
        return None


def named_tensors(
    reader: gguf.GGUFReader, path: str, checkpoint_names: Iterable[str], num_layers: int
) -> Iterator[tuple[str, gguf.ReaderTensor]]:
    gguf_arch = ARCHITECTURES[gguf_architecture(reader, path)][0]
    tensor_names = gguf.get_tensor_name_map(gguf_arch, num_layers)
    by_gguf_name = {}
    for name in checkpoint_names:
        module, suffix = name.rsplit(".", 1)
        gguf_module = tensor_names.get_name(module)
        if gguf_module is not None:
            by_gguf_name[f"{gguf_module}.{suffix}"] = name
    for tensor in reader.tensors:
        yield by_gguf_name.get(tensor.name, tensor.name), tensor


def four_bit_codes(tensor: gguf.ReaderTensor) -> FourBitCodes:
    """A Q4_0, Q4_1 or Q4_K matrix's codes, and each 32-value group's scale and offset."""
    return codes_of(tensor.tensor_type, tensor.data)


def codes_of(qtype: gguf.GGMLQuantizationType, data: np.ndarray) -> FourBitCodes:
    """The codes, scales and offsets of rows of 4-bit blocks (`data`: `[..., row bytes]`),
    a row of `FourBitCodes` each.

    A block starts with its float16 scales and ends with its codes, two to a byte: the low
    nibbles of a run of bytes are one run of values, their high nibbles the next.
    """
    codes_start, run = FOUR_BIT_TYPES[qtype]
    rows = int(np.prod(data.shape[:-1]))
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    packed = blocks[:, codes_start:].reshape(len(blocks), -1, 1, run)
    shifts = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = np.bitwise_and(packed >> shifts, 0x0F, dtype=np.int32)  # torch's int4 packing's type
    scales, offsets = group_scales(qtype, blocks)
    return FourBitCodes(
        *(torch.from_numpy(array.reshape(rows, -1)) for array in (codes, scales, offsets))
    )


def group_scales(
    qtype: gguf.GGMLQuantizationType, blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each group's scale and offset, in float32, computed as llama.cpp dequantizes.

    Q4_0: `w = d * (code - 8)`; Q4_1: `w = d * code + m`. A Q4_K super-block holds 8 groups:
    after its two float16 scales `d` and `dmin`, 12 bytes pack each group's 6-bit
    multipliers `sc` and `m` (unpacked by the `gguf` package), and `w = d * sc * code -
    dmin * m`.
    """
    d = half(blocks[:, 0:2])
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return d, -8 * d
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        return d, half(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(half(blocks[:, 2:4]) * m.astype(np.float32))


def half(pairs: np.ndarray) -> np.ndarray:
    """Pairs of bytes read as float16 numbers, in float32, one per row."""
    return np.ascontiguousarray(pairs).view(np.float16).astype(np.float32)


def dequantize(
    qtype: gguf.GGMLQuantizationType, data: np.ndarray, name: str, path: str
) -> torch.Tensor:
    """Rows of the file's tensor `name` (`data`: `[..., row bytes]`), in float32."""
    if qtype in FOUR_BIT_TYPES:  # torch's vectorized arithmetic, not numpy's per row
        return codes_of(qtype, data).weight().view(*data.shape[:-1], -1)
    try:
        values = dequantized_rows(qtype, data)
    except NotImplementedError as error:
        raise ValueError(
            f"{path}: tensor {name!r} has type {qtype.name}, which cannot be dequantized"
        ) from error
    # Unquantized types come back as views of the read-only memory-mapped file.
    return torch.from_numpy(np.array(values, copy=not values.flags.writeable))


def dequantized_rows(qtype: gguf.GGMLQuantizationType, data: np.ndarray) -> np.ndarray:
    """`gguf.dequantize`'s numbers, `ROWS_PER_DEQUANTIZE` rows at a time (gguf's 16: slower)."""
    quant = getattr(gguf.quants, qtype.name, None)  # a class per block type: Q6_K, IQ2_XS, ...
    if quant is None:  # F32 and F16, which gguf views or converts whole
        return gguf.dequantize(data, qtype)
    rows = data.reshape(-1, data.shape[-1])
    groups = [quant.dequantize_rows(rows[start : start + ROWS_PER_DEQUANTIZE])
              for start in range(0, len(rows), ROWS_PER_DEQUANTIZE)]
    return np.concatenate(groups).reshape(*data.shape[:-1], -1)


class PlainArrayReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over the same memory-mapped file, read through a plain array view.

    The reader slices its `np.memmap` once per metadata value and tensor, and a memmap
    slice runs Python bookkeeping of its own: with a Qwen tokenizer's 150,000 strings and
    merges in the metadata, that alone took 49 s a file on a busy 2-core machine. A plain
    view of the mapping reads the same bytes without it.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # set by GGUFReader's __init__
        self._plain, self._mapping = mapped.view(np.ndarray), mapped._mmap

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        """`count` numbers at `offset`: GGUFReader's own, without its per-call dtype
        bookkeeping where the file's byte order is this machine's (almost always)."""
        if self.byte_order != "I" or override_order not in (None, "I"):
            return super()._get(offset, dtype, count, override_order)
        dtype = np.dtype(dtype)
        return self._plain[offset : offset + dtype.itemsize * int(count)].view(dtype)

    def drop_pages(self, tensor: gguf.ReaderTensor) -> None:
        """Give back the memory that the read pages of `tensor` take in this process (the
        kernel's page cache keeps the file: reading them again reads them from there)."""
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        end = tensor.data_offset + tensor.n_bytes
        self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


@contextmanager
def transformers_reading_plainly() -> Iterator[None]:
    """transformers reads a config with `gguf.GGUFReader`, imported from the package as it
    reads: ours (`TensorReader`) meanwhile, as no config value is an array. Its tokenizer
    reads the vocabulary and merges over an `np.memmap`: a plain view of it instead
    (`PlainArrayReader` says why). As a config so read counts no tokens, the check of its
    special tokens against an empty vocabulary is silenced (`read_gguf_config` sizes it)."""
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(gguf, "GGUFReader", TensorReader))
        config_log = logging.getLogger("transformers.configuration_utils")
        config_log.addFilter(empty_vocabulary)
        patches.callback(config_log.removeFilter, empty_vocabulary)
        try:
            from transformers.integrations.gguf import reader
        except ImportError:  # an older transformers reads through gguf's reader only
            reader = None
        if hasattr(reader, "_mapped"):
            patches.enter_context(mock.patch.object(reader, "_mapped", mapped_plainly))
        yield


def empty_vocabulary(record: logging.LogRecord) -> bool:
    """False for transformers' warning that a token id is outside a vocabulary of 0 tokens."""
    return "(between 0 and -1)" not in record.getMessage()


def mapped_plainly(path: str) -> np.ndarray:
    """The file's bytes: a plain view of a read-only memory map, which it keeps open."""
    return np.memmap(path, mode="r", dtype=np.uint8).view(np.ndarray)


class TensorReader(PlainArrayReader):
    """`PlainArrayReader` that steps over the metadata's arrays (a tokenizer's vocabulary,
    token types and merges) without reading them, item by item as gguf does: their fields
    have no contents. Ours, and a config's, are the metadata's single values and the
    tensors."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        item_type = self._get(orig_offs, np.uint32) if raw_type == gguf.GGUFValueType.ARRAY else None
        item = None if item_type is None else gguf.GGUFValueType(item_type[0])
        if item not in (*self.gguf_scalar_to_np, gguf.GGUFValueType.STRING) or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        length = self._get(orig_offs + 4, np.uint64)
        offset = orig_offs + 12
        if item == gguf.GGUFValueType.STRING:
            for _ in range(int(length[0])):  # each string: its uint64 length, then its bytes
                offset += 8 + struct.unpack_from("<Q", self._mapping, offset)[0]
        else:
            offset += int(length[0]) * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        return offset - orig_offs, [item_type, length], [], [gguf.GGUFValueType.ARRAY, item]


def open_gguf(path: str) -> gguf.GGUFReader:
    try:
        return TensorReader(path)
    except Exception as error:  # a damaged file fails in struct, numpy or gguf's own checks
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def gguf_architecture(reader: gguf.GGUFReader, path: str) -> str:
    architecture = metadata(reader, "general.architecture")
    if architecture in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported: nanoqwen runs the "
            "hybrid (linear-attention) models from their Hugging Face checkpoints only"
        )
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; nanoqwen runs "
            + ", ".join(ARCHITECTURES)
        )
    return architecture


def metadata(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def linear_weight_bits(reader: gguf.GGUFReader) -> int:
    """Nominal bits per weight of the type that holds most of the decoder's matrices."""
    elements: Counter[gguf.GGMLQuantizationType] = Counter()
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) > 1:  # experts: 3-D
            elements[tensor.tensor_type] += int(tensor.n_elements)
    if not elements:
        return 32
    # Type names carry their bits: F16, BF16, Q8_0, Q4_K, IQ2_XS, MXFP4, ...
    return int(re.search(r"\d+", elements.most_common(1)[0][0].name).group())
