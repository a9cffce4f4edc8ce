"""Stream a checkpoint's weights into the fused model.

A checkpoint (`checkpoint.py`) is a directory with `config.json`, tokenizer files and one
or more `.safetensors` files (several "shards" plus a `model.safetensors.index.json` for
large models), or a single llama.cpp `.gguf` file.

Loading reads one tensor at a time, so peak memory is the model plus one tensor, and
maps transformers' names onto our fused parameters: `q_proj`, `k_proj`, `v_proj` become
row blocks of `qkv_proj`; `gate_proj`, `up_proj` become row blocks of `gate_up_proj`.
Every parameter row must be written exactly once: a weight the checkpoint lacks, one we
don't know, or one of the wrong shape is an error naming that weight.

Quantized checkpoints arrive as float tensors like any other: a GGUF file's tensors are
dequantized as they are read (`gguf.py`), a GPTQ/AWQ layer's packed integers
unpacked (`gptq_awq.py`). Once the model is full, `quantization.py` can store its linear
weights as int8 or int4 again, with the kernels torchao has for them.

With tensor parallelism each rank reads only its slice of each tensor
(`iter_checkpoint_shard`): safetensors maps the file and copies just the rows or columns
asked for, so no rank ever holds a full weight it does not keep. That needs plain
safetensors tensors, kept in the model's dtype: GGUF blocks and GPTQ/AWQ packing do not
slice that way, and quantizing each rank's slices is not supported yet.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from safetensors import safe_open

from nanoqwen.model.config import ModelConfig
from nanoqwen.model.qwen import QwenForCausalLM, RotaryEmbedding
from nanoqwen.parallel.sharding import SINGLE, TensorParallel
from nanoqwen.weights.checkpoint import Checkpoint
from nanoqwen.weights.formats import PackedWeights, WeightQuantization
from nanoqwen.weights.gguf import iter_gguf_tensors
from nanoqwen.weights.gptq_awq import unpack_checkpoint
from nanoqwen.weights.quantization import quantize_linears

# transformers name → (our fused parameter, index of its block).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
) -> QwenForCausalLM:
    """Build the decoder (`tp`'s rank's part of it) on `device` in `dtype` and fill it from
    `checkpoint`.

    `quantization` ("none", "int8", "int4", or None to follow the checkpoint) says how the
    linear weights are kept in memory once loaded. They are loaded in `dtype` first, so
    memory peaks at the full-precision model before the quantized weights replace them.
    """
    path, config = checkpoint.path, checkpoint.model_config
    # Build on the meta device (no memory, no random init), then allocate for real.
    with default_dtype(dtype), torch.device("meta"):
        model = QwenForCausalLM(config, tp)
    model.to_empty(device=device)
    model.tie_weights()  # allocation gave the tied pair two separate tensors
    model.rotary = RotaryEmbedding(config).to(device)  # computed, not loaded
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {name: set() for name in params}
    shard = tp.shard_config(config)  # the shapes this rank's parameters have
    if tp.size > 1:
        tensors = iter_checkpoint_shard(path, config, tp)
    elif checkpoint.is_gguf:
        tensors = iter_gguf_tensors(path, checkpoint_names(params), config.num_layers)
    else:
        tensors = iter_checkpoint(path, checkpoint.packed)
    for name, tensor in tensors:
        target, block = map_name(name, config)
        if target is None or (target not in params and is_unused_zero_bias(name, tensor, checkpoint)):
            continue
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint {path}")
        copy_block(params[target], tensor, block, shard, name)
        filled[target].add(block)
    check_all_filled(filled, shard, path)
    scheme = runtime_quantization(quantization, checkpoint)
    if scheme is not None:
        quantize_linears(model, scheme)
    return model.eval()


def runtime_quantization(
    quantization: str | None, checkpoint: Checkpoint
) -> WeightQuantization | None:
    """What `quantization` asks for: None follows the checkpoint, "none" keeps full weights."""
    own = checkpoint.quantization
    if quantization is None:
        return own
    if quantization == "none":
        return None
    if quantization == "int4" and own is not None and own.mode == "int4":
        return own  # with the checkpoint's group size
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
    """Yield (name, tensor) from every safetensors shard, one tensor at a time; a GPTQ/AWQ
    layer's packed parts as one unpacked `weight`."""
    with ExitStack() as stack:
        # A layer's packed parts may sit in different shards: keep them all open.
        shard_of = {}
        for path in safetensors_files(model_dir):
            shard = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            shard_of.update(dict.fromkeys(shard.keys(), shard))

        def read(name: str) -> torch.Tensor:
            return shard_of[name].get_tensor(name)

        if packed is None:
            yield from ((name, read(name)) for name in shard_of)
        else:
            yield from unpack_checkpoint(shard_of, read, packed)


def iter_checkpoint_shard(
    model_dir: str, config: ModelConfig, tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, this rank's part of the tensor), reading only that part of the file."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():
                yield name, tp.read_shard(shard.get_slice(name), name, config)


def check_splittable(checkpoint: Checkpoint, quantization: str | None) -> None:
    """A ValueError unless the weights can be split across ranks: each rank reads its
    slices of plain safetensors tensors and keeps them in the model's dtype."""
    kind, path = checkpoint.format_name, checkpoint.path
    if kind is not None:
        raise ValueError(
            "tensor parallelism reads each rank's slices of plain safetensors weights, "
            f"which a {kind} checkpoint does not have ({path}): use tensor_parallel_size=1 "
            "or a checkpoint of float weights"
        )
    if quantization not in (None, "none"):
        raise ValueError(
            f"quantization={quantization!r} does not work with tensor parallelism yet: "
            "use quantization='none' or tensor_parallel_size=1"
        )


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
    for part, (_, block) in FUSED.items():
        if f".{part}." in name:
            return fused_name(name), block
    return name, 0


def block_rows(param_name: str, config: ModelConfig) -> list[int]:
    """How many rows each block of a (possibly fused) parameter has."""
    if ".qkv_proj." in param_name:
        kv = config.num_kv_heads * config.head_dim
        return [config.num_heads * config.head_dim, kv, kv]
    if ".gate_up_proj." in param_name:
        return [config.intermediate_size] * 2
    return []


def copy_block(
    param: torch.Tensor, tensor: torch.Tensor, block: int, config: ModelConfig, name: str
) -> None:
    target = param.data
    rows = block_rows(fused_name(name), config)
    if rows:
        target = target.narrow(0, sum(rows[:block]), rows[block])
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch for weight {name!r}: checkpoint has {tuple(tensor.shape)}, "
            f"model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)


def fused_name(name: str) -> str:
    for part, (fused, _) in FUSED.items():
        name = name.replace(f".{part}.", f".{fused}.")
    return name


def checkpoint_names(params: dict[str, torch.Tensor]) -> list[str]:
    """transformers' names of the weights that fill `params`: fused ones split up again."""
    names = []
    for name in params:
        parts = [part for part, (fused, _) in FUSED.items() if f".{fused}." in name]
        names.extend(name.replace(f".{FUSED[part][0]}.", f".{part}.") for part in parts)
        if not parts:
            names.append(name)
    return names


def check_all_filled(filled: dict[str, set[int]], config: ModelConfig, model_dir: str) -> None:
    for name, blocks in filled.items():
        expected = len(block_rows(name, config)) or 1
        if len(blocks) < expected:
            raise ValueError(f"missing weight {name!r} in checkpoint {model_dir}")
