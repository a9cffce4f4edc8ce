"""Stream a checkpoint's weights into the fused model, then keep them in the form asked for.

A checkpoint (`checkpoint.py`) is a directory with `config.json`, tokenizer files and one
or more `.safetensors` files (several "shards" plus a `model.safetensors.index.json` for
large models), or a single llama.cpp `.gguf` file.

Loading reads one tensor at a time, and maps transformers' names onto our fused
parameters: `q_proj`, `k_proj`, `v_proj` become row blocks of `qkv_proj`; `gate_proj`,
`up_proj` become row blocks of `gate_up_proj`.
Every parameter row must be written exactly once: a weight the checkpoint lacks, one we
don't know, or one of the wrong shape is an error naming that weight.

A safetensors file is 8 bytes giving the length of a JSON header, the header (each
tensor's dtype, shape and byte range), then the tensors' bytes. We memory-map the file and
hand each tensor over as a view of the mapping (`torch.frombuffer`), unread: each
parameter's loader (`model/layers.py`) indexes the part it keeps and copies it, and only
the pages it copies are read, so a model split across ranks reads only its slices. A page
read through a mapping stays mapped into the process, and counts in its resident memory
(RSS), until it is unmapped or the process says it is done with it: the kernel may drop
such a page under pressure (it is a copy of the file), but until it does, reading a 3 GB
file through a mapping and copying it out holds 3 GB twice. So once the consumer of a
tensor asks for the next, the loader tells the kernel (`madvise(MADV_DONTNEED)`) that no
page of the mapping is needed here any more: they leave the process (and stay in the
kernel's page cache, for the next process that loads the file). The safetensors library
reads through a mapping of its own, which it cannot be asked to give back, hence the few
lines reading the format here. Loading peaks at the model plus one tensor; a weight form
(below) that replaces the loaded weights one at a time frees each as it goes (nothing here
holds them), so oneDNN packing adds one weight to that peak, not the model.

Quantized checkpoints arrive as float tensors like any other: a GGUF file's tensors are
dequantized where they are read (`gguf.py`), a GPTQ/AWQ layer's packed integers unpacked
(`gptq_awq.py`). Once the model is full, one *weight form* may convert its linear layers
(`WEIGHT_FORMS`, a table, each form in its own module, imported only when used): int8 or
int4 codes with their kernels (`quantization.py`), or, for a float32 model on a CPU (and a
bf16 one where the CPU has bf16 arithmetic), oneDNN's prepacked layout (`model/packed.py`).
One form cannot wait for a full model, as that would be many times its size: a 4-bit GGUF
file on a CPU keeps each layer's own codes as its tensors arrive (`KEPT_AS_LOADED`,
`gguf_codes.py`).
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nanoqwen.config import cpu_has_native_bf16
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.loading import ShapeMismatch, TensorSlice, load_whole
from nanoqwen.model.qwen import QwenForCausalLM, rotary_embedding
from nanoqwen.weights.checkpoint import Checkpoint
from nanoqwen.weights.formats import PackedWeights, WeightQuantization

Loader = Callable[[torch.Tensor, TensorSlice, int], torch.Tensor]
# transformers name → (our fused parameter, index of its block).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# safetensors' names of the element types it stores.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# The forms linear weights may be kept in after loading: each converts a loaded model in
# place, `convert(model, checkpoint, num_blocks, scheme)` (`num_blocks` from `fill_parameters`),
# from a module imported only when used.
WEIGHT_FORMS = {
    "int8": "nanoqwen.weights.quantization:keep_quantized",
    "int4": "nanoqwen.weights.quantization:keep_quantized",
    "onednn_packed": "nanoqwen.model.packed:pack_linear_weights",
}
# The forms each layer takes as its tensors arrive, so no full-precision model is ever
# made: `allocate(model, device)` gives the meta-built model memory in place of
# `allocate_whole`, and returns loaders that build each layer's kept form.
KEPT_AS_LOADED = {"gguf_codes": "nanoqwen.weights.gguf_codes:allocate_kept"}
# Set by a command line to show the load's progress: called with (tensors loaded, of all).
on_tensor_loaded: Callable[[int, int], None] | None = None


def load_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> QwenForCausalLM:
    """Build the decoder on `device` in `dtype` and fill it from `checkpoint`. Built inside
    `model.layers.split_across(...)`, it is one rank's slice, and reads only that slice.

    `quantization` ("none", "int8", "int4", or None to follow the checkpoint) says how the
    linear weights are kept in memory once loaded. They are loaded in `dtype` first, so
    memory peaks at the full-precision model before the quantized weights replace them;
    but a `KEPT_AS_LOADED` form keeps each layer as it loads.
    """
    config = checkpoint.model_config
    scheme = runtime_quantization(quantization, checkpoint, device)
    form = weight_form(scheme, checkpoint, dtype, device)
    # Build on the meta device (no memory, no random init), then allocate for real.
    with default_dtype(dtype), torch.device("meta"):
        model = QwenForCausalLM(config)
    allocate = imported(KEPT_AS_LOADED[form]) if form in KEPT_AS_LOADED else allocate_whole
    num_blocks = fill_parameters(checkpoint, allocate(model, device))
    model.rotary = rotary_embedding(config).to(device)  # computed, not loaded
    if form in WEIGHT_FORMS:
        imported(WEIGHT_FORMS[form])(model, checkpoint, num_blocks, scheme)
    return model.eval()


def fill_parameters(
    checkpoint: Checkpoint, params: dict[str, tuple[torch.Tensor, Loader, int]]
) -> dict[str, int]:
    """Copy each checkpoint tensor into its parameter (`params`: each one's loader, as
    `parameter_loaders` gives them); return how many checkpoint weights are fused into each
    parameter, by name. No parameter outlives this call here: a weight form replaces them
    one by one, and holding the loaded ones would hold the model twice."""
    filled: dict[str, set[int]] = {name: set() for name in params}
    loaded, total = 0, sum(blocks for _, _, blocks in params.values())
    for name, source in checkpoint_tensors(checkpoint, params):
        target, block = map_name(name, checkpoint.model_config)
        if target is None or (target not in params and is_unused_zero_bias(name, source, checkpoint)):
            continue
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint {checkpoint.path}")
        param, load, _ = params[target]
        try:
            load(param, source, block)
        except ShapeMismatch as error:
            raise ValueError(f"shape mismatch for weight {name!r}: {error}") from None
        filled[target].add(block)
        loaded += 1
        if on_tensor_loaded is not None:
            on_tensor_loaded(loaded, total)
    num_blocks = {name: blocks for name, (_, _, blocks) in params.items()}
    for name, blocks in num_blocks.items():
        if len(filled[name]) < blocks:
            raise ValueError(f"missing weight {name!r} in checkpoint {checkpoint.path}")
    return num_blocks


def allocate_whole(model: nn.Module, device: torch.device) -> dict[str, tuple[torch.Tensor, Loader, int]]:
    """Give every parameter of `model`, built on the meta device, memory on `device`."""
    model.to_empty(device=device)
    model.tie_weights()  # allocation gave the tied pair two separate tensors
    return parameter_loaders(model)


def imported(function: str) -> Callable:
    """The function a table names as "module:function", imported now."""
    module, name = function.split(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_tensors(
    checkpoint: Checkpoint, params: dict[str, object]
) -> Iterator[tuple[str, TensorSlice]]:
    """The checkpoint's tensors by name, each read as its format stores it (a sparse model's
    stacked experts as one view per expert, `model/moe.py`'s `split_expert_stacks`)."""
    config = checkpoint.model_config
    if checkpoint.is_gguf:
        from nanoqwen.weights.gguf import iter_gguf_tensors

        tensors = iter_gguf_tensors(checkpoint.path, checkpoint_names(params), config.num_layers)
    else:
        tensors = iter_checkpoint(checkpoint.path, checkpoint.packed)
    if config.moe is None:
        return tensors
    from nanoqwen.model.moe import split_expert_stacks

    return (piece for name, source in tensors
            for piece in split_expert_stacks(name, source, config.moe))


def weight_form(
    scheme: WeightQuantization | None, checkpoint: Checkpoint, dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    """Which `WEIGHT_FORMS` entry the loaded linear weights take (None: they stay as loaded).

    int4 of a GGUF file on a CPU keeps the file's own 4-bit codes: the tensors stored in
    Q4_0, Q4_1 or Q4_K become `Int4Linear`s of their codes, the others and the embedding
    int8 rows, which hold them more closely than 4 bits could. Elsewhere int4 re-rounds the
    weights onto torchao's grid. A float32 model on a CPU is prepacked for oneDNN, and a bf16 one
    where the CPU multiplies bf16 in hardware.
    """
    if scheme is not None:
        file_codes = scheme.mode == "int4" and checkpoint.is_gguf and device.type == "cpu"
        return "gguf_codes" if file_codes else scheme.mode
    onednn_pays = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())
    packs = device.type == "cpu" and torch.backends.mkldnn.is_available() and onednn_pays
    return "onednn_packed" if packs else None


def parameter_loaders(model: nn.Module) -> dict[str, tuple[torch.Tensor, Loader, int]]:
    """Every parameter by name, with the function that loads it from a checkpoint tensor
    (its module's `load_block`, or whole) and how many checkpoint weights are fused in it."""
    loaders, seen = {}, set()
    for module_name, module in model.named_modules():
        load = getattr(module, "load_block", load_whole)
        num_blocks = getattr(module, "num_blocks", 1)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied lm_head: the embedding's own weight
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            loaders[name] = (param, load, num_blocks)
    return loaders


def runtime_quantization(
    quantization: str | None, checkpoint: Checkpoint, device: torch.device
) -> WeightQuantization | None:
    """What `quantization` asks for: None follows the checkpoint, "none" keeps full weights.
    int4 keeps a GPTQ/AWQ checkpoint's or a GGUF file's group size."""
    own = checkpoint.quantization
    if quantization is None:
        return own
    if quantization == "none":
        return None
    if quantization == "int4" and own is not None and own.mode == "int4":
        return own
    return WeightQuantization(quantization)


def is_unused_zero_bias(name: str, tensor: torch.Tensor, checkpoint: Checkpoint) -> bool:
    """GPTQ tools store a bias of zeros for every quantized layer, even those without one."""
    return checkpoint.packed is not None and name.endswith(".bias") and not tensor.any()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def iter_checkpoint(
    model_dir: str, packed: PackedWeights | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every safetensors shard, one tensor at a time, each a view
    of the mapped file read only as far as its parameter indexes it; a GPTQ/AWQ layer's
    packed parts (which may sit in different shards) as one unpacked `weight`."""
    mappings, tensors = [], {}
    for path in safetensors_files(model_dir):
        mapping, shard = map_safetensors(path)
        mappings.append(mapping)
        tensors.update(shard)
    if packed is None:
        pieces = iter(tensors.items())
    else:
        from nanoqwen.weights.gptq_awq import unpack_checkpoint

        pieces = unpack_checkpoint(tensors, tensors.__getitem__, packed)
    for piece in pieces:
        yield piece
        # The consumer has copied what it keeps: the pages it read leave this process.
        for mapping in mappings:
            mapping.madvise(mmap.MADV_DONTNEED)


def map_safetensors(path: str) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """A safetensors file mapped into memory, and its tensors as views of the mapping. The
    mapping is copy-on-write, so torch may view it as writable; nothing writes to it."""
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_size))
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        dtype, (begin, end) = SAFETENSORS_DTYPES[entry["dtype"]], entry["data_offsets"]
        if begin == end:  # torch.frombuffer cannot view zero bytes
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        count, offset = (end - begin) // dtype.itemsize, 8 + header_size + begin
        view = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
        tensors[name] = view.view(entry["shape"])
    return mapping, tensors


def safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights found in {model_dir}")
    return [os.path.join(model_dir, file) for file in files]


def map_name(name: str, config: ModelConfig) -> tuple[str | None, int]:
    """transformers' parameter name → (our parameter name or None to skip, block index)."""
    if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
        return None, 0  # computed buffers, or a copy of the embedding we already tie to
    if name.startswith("mtp."):
        return None, 0  # Qwen3-Next's multi-token-prediction head, which nothing here runs
    if config.moe is not None:
        from nanoqwen.model.moe import moe_checkpoint_name

        expert = moe_checkpoint_name(name, config.moe)
        if expert is not None:
            return expert
    for part, (_, block) in FUSED.items():
        if f".{part}." in name:
            return fused_name(name), block
    return name, 0


def fused_name(name: str) -> str:
    for part, (fused, _) in FUSED.items():
        name = name.replace(f".{part}.", f".{fused}.")
    return name


def checkpoint_names(params: dict[str, object]) -> list[str]:
    """transformers' names of the weights that fill `params`: fused ones split up again."""
    names = []
    for name in params:
        parts = [part for part, (fused, _) in FUSED.items() if f".{fused}." in name]
        names.extend(name.replace(f".{FUSED[part][0]}.", f".{part}.") for part in parts)
        if not parts:
            names.append(name)
    return names
