"""A checkpoint: where its files are, the model's shape, and how it stores its weights.

`open_checkpoint` takes what a user types (a hub id, a local directory, a `.gguf` file),
downloads a hub id's files if needed, and reads the config: from `config.json` through
transformers' `AutoConfig`, or from a GGUF file's metadata. Besides the model's shape
(`ModelConfig`) it says how the weights are stored: `packed` for GPTQ/AWQ integer layouts,
and `quantization`, what keeps them about as small in memory at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from huggingface_hub import snapshot_download
from transformers import AutoConfig

from nanoqwen.model.config import ModelConfig
from nanoqwen.weights.formats import (
    GGUF_GROUP_SIZE,
    PackedWeights,
    WeightQuantization,
    is_gguf_file,
    quantization_for_bits,
)


@dataclass(frozen=True)
class Checkpoint:
    path: str  # a local directory, or a .gguf file
    model_config: ModelConfig
    packed: PackedWeights | None = None  # a GPTQ/AWQ checkpoint's integer layout
    # How small the checkpoint keeps its weights, and so the run-time default.
    quantization: WeightQuantization | None = None

    @property
    def is_gguf(self) -> bool:
        return is_gguf_file(self.path)

    @property
    def format_name(self) -> str | None:
        """"GGUF", "GPTQ" or "AWQ" for a quantized checkpoint; None for plain weights."""
        if self.is_gguf:
            return "GGUF"
        return self.packed.method.upper() if self.packed is not None else None


def open_checkpoint(model: str) -> Checkpoint:
    """The checkpoint a hub id, directory or GGUF file names (downloaded if need be)."""
    return read_checkpoint(resolve_model_path(model))


def read_checkpoint(path: str) -> Checkpoint:
    """The config of a local checkpoint directory or GGUF file."""
    if is_gguf_file(path):
        from nanoqwen.weights.gguf import read_gguf_config

        hf, bits = read_gguf_config(path)
        return Checkpoint(
            path, ModelConfig.from_hf(hf), quantization=quantization_for_bits(bits, GGUF_GROUP_SIZE)
        )
    try:
        hf = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"could not read the model config in {path}: {error}") from error
    packed = getattr(hf, "quantization_config", None)
    if packed is None:
        return Checkpoint(path, ModelConfig.from_hf(hf))
    packed = PackedWeights.from_hf(packed, source=f"{path}/config.json")
    return Checkpoint(path, ModelConfig.from_hf(hf), packed, packed.runtime_quantization())


CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def resolve_model_path(model: str) -> str:
    """A local directory or GGUF file as is; otherwise a hub id, downloaded (or found in the
    local cache). A directory must hold a config.json."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(
                f"no config.json in {model}: pass a Qwen2/Qwen3 checkpoint directory, "
                "a .gguf file or a hub id"
            )
        return model
    if is_gguf_file(model):
        return model
    if os.path.isfile(model):
        raise ValueError(f"{model} is a file: pass a checkpoint directory or a .gguf file")
    looks_like_path = (
        model.startswith((".", "/", "~")) or model.count("/") != 1 or model.endswith(".gguf")
    )
    if looks_like_path:
        raise ValueError(f"model path not found: {model}")
    try:
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES)
    except Exception as error:  # network, auth or missing-repo errors all mean the same here
        raise ValueError(
            f"could not find model {model!r} locally or download it from the hub "
            f"({type(error).__name__}); pass a local checkpoint directory instead"
        ) from error
