"""Load a 4-bit GGUF file on a CPU straight into the form its weights are kept in.

This is the loader's "gguf_codes" weight form (`loader.KEPT_AS_LOADED`). A linear layer
whose tensors are all stored in Q4_0, Q4_1 or Q4_K becomes an `Int4Linear` of the file's
own codes, never dequantized; any other linear is dequantized a few thousand rows at a
time as its tensors arrive and kept as int8 rows at once (`Int8Linear`); the embedding is
int8 rows too (`Int8Embedding`), whose codes a tied lm_head multiplies by. So the model
never exists in full precision: a Qwen2.5-1.5B Q4_K_M file (1 GB) loads into about its
own size, where its float32 model would take 6 GB first (docs/python-api.md has the
figures).

How: the loader builds the model on the meta device, as for any checkpoint, and asks
`allocate_kept` for memory instead of allocating the model whole. The norms, the biases
and a mixture of experts' stacks get memory and load as from any checkpoint. Each linear
weight and the embedding get a `KeptLayer` as their loader: it turns each of the layer's
tensors (q, k and v of a fused `qkv_proj`) into codes as it arrives, reading it once, and
puts the layer's kept form in the model when the last one has.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.model.layers import VocabParallelEmbedding
from nanoqwen.model.loading import ShapeMismatch, TensorSlice
from nanoqwen.weights.formats import FourBitCodes
from nanoqwen.weights.gguf import FileTensor
from nanoqwen.weights.loader import Loader, parameter_loaders
from nanoqwen.weights.quantization import (
    INT4_CPU_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    int8_rows,
    replace_module,
)

# Rows dequantized at a time into float32 on their way to int8: a 1,536-wide embedding's
# 8,192 rows are 50 MB, where its 151,936 rows at once would be 934 MB.
ROWS_PER_READ = 8192
Int8Rows = tuple[torch.Tensor, torch.Tensor]  # (codes, scales), `int8_rows`


def allocate_kept(model: nn.Module, device: torch.device) -> dict[str, tuple[torch.Tensor, Loader, int]]:
    """Give memory on `device` to the parameters of `model` (built on the meta device)
    other than its linear weights and its embedding, and return every parameter's loader
    (`loader.parameter_loaders`), theirs a `KeptLayer`'s."""
    loaders = {}
    for name, (param, load, num_blocks) in parameter_loaders(model).items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attribute == "weight" and isinstance(module, (nn.Linear, VocabParallelEmbedding)):
            loaders[name] = (param, KeptLayer(model, module_name, num_blocks).load, num_blocks)
        else:
            real = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
            setattr(module, attribute, real)
            loaders[name] = (real, load, num_blocks)
    return loaders


class KeptLayer:
    """Loads one linear layer's (or the embedding's) checkpoint tensors, `num_blocks` of
    them fused, and replaces the module by its kept form once all have arrived."""

    def __init__(self, model: nn.Module, name: str, num_blocks: int) -> None:
        self.model, self.name, self.num_blocks = model, name, num_blocks
        self.blocks: dict[int, FourBitCodes | Int8Rows] = {}

    def load(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        """The loader's `load(param, source, block)`: `source` is a `gguf.FileTensor`."""
        assert isinstance(source, FileTensor)
        module = self.model.get_submodule(self.name)
        # A fused layer's blocks are its row blocks (`ColumnParallelLinear.splits`).
        splits = getattr(module, "splits", None)
        expected = (splits[block].length, param.shape[1]) if splits else tuple(param.shape)
        if source.shape != expected:
            raise ShapeMismatch(source.shape, expected)
        codes = source.four_bit_codes() if isinstance(module, nn.Linear) else None
        self.blocks[block] = codes if codes is not None else read_int8_rows(source)
        if len(self.blocks) == self.num_blocks:
            self.keep(module, param)
        return param

    def keep(self, module: nn.Module, param: torch.Tensor) -> None:
        blocks = [self.blocks.pop(index) for index in range(self.num_blocks)]
        if isinstance(module, VocabParallelEmbedding):
            (rows,) = blocks
            replace_module(self.model, self.name, Int8Embedding(*rows, param.dtype))
            if self.model.config.tie_word_embeddings:  # the lm_head multiplies by the same codes
                replace_module(self.model, "lm_head", Int8Linear(self.model.lm_head, rows))
        elif all(isinstance(part, FourBitCodes) for part in blocks) and (
            module.out_features % INT4_CPU_ROWS == 0  # what torch's int4 kernel takes
        ):
            replace_module(self.model, self.name, Int4Linear(module, FourBitCodes.stacked(blocks)))
        else:  # int8 rows are each row's own: a fused weight's are its blocks' one after another
            parts = [int8_rows(part.weight()) if isinstance(part, FourBitCodes) else part for part in blocks]
            rows = (torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts]))
            replace_module(self.model, self.name, Int8Linear(module, rows))


def read_int8_rows(source: FileTensor) -> Int8Rows:
    """A 2-D tensor of the file as int8 rows (`int8_rows`), `ROWS_PER_READ` rows read at a time."""
    rows = source.shape[0]
    codes, scales = torch.empty(source.shape, dtype=torch.int8), torch.empty(rows, dtype=torch.bfloat16)
    for start in range(0, rows, ROWS_PER_READ):
        stop = min(start + ROWS_PER_READ, rows)
        codes[start:stop], scales[start:stop] = int8_rows(source[start:stop])
    return codes, scales
