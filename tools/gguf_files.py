"""GGUF files written with the `gguf` package from checkpoint directories: tiny ones for
the tests, model-sized ones of random weights for benchmarks.

A GGUF file is llama.cpp's single-file checkpoint: the config and the tokenizer live in its
metadata under llama.cpp's key names, and the tensors under llama.cpp's names
(`blk.0.attn_q.weight`), each in its own type (F32, F16, BF16, Q8_0, Q4_K, ...).
`write_gguf` writes the weights of a transformers checkpoint directory (a dense or a
mixture-of-experts Qwen) that way, choosing each tensor's type with a function of its GGUF
name, as llama.cpp's "mixes" (Q4_K_M and friends) choose different types for different
tensors.

Types the `gguf` package can quantize (F16, BF16, Q8_0, Q4_0, Q5_0, ...) encode the
checkpoint's own weights. The k-quants (Q4_K, Q5_K, Q6_K) have no quantizer in the package,
so those tensors get random codes and sub-block scales, with super-block scales chosen to
give the weights the checkpoint's spread, centred on zero: a valid file of that type that
both nanoqwen and transformers must read identically, though its weights are not the
checkpoint's. Other types without a quantizer get random bytes.

For a benchmark, write a random-weights model of a preset shape (`checkpoints.py`) in a
mix like llama.cpp's Q4_K_M, and run every engine on that one file:

    python -m tools.gguf_files qwen2.5-1.5b qwen2.5-1.5b-q4_k_m.gguf
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import gguf
import numpy as np
import torch
from safetensors import safe_open

from tools.checkpoints import random_checkpoint

F = gguf.GGMLQuantizationType
# Where each k-quant block keeps its float16 super-block scale `d` and, for the types
# with one, the scale `dmin` of its sub-blocks' minimums; and the dmin/d ratio that
# centres random codes (0-15 for Q4_K, 0-31 for Q5_K) on zero. Q6_K's codes are signed.
K_QUANT_SCALES = {F.Q4_K: (0, 2, 7.5), F.Q5_K: (0, 2, 15.5), F.Q6_K: (208, None, 0.0)}
# transformers' model type → llama.cpp's architecture name, and gguf's enum for its tensor names.
ARCHITECTURES = {
    "qwen2": ("qwen2", gguf.MODEL_ARCH.QWEN2),
    "qwen3": ("qwen3", gguf.MODEL_ARCH.QWEN3),
    "qwen2_moe": ("qwen2moe", gguf.MODEL_ARCH.QWEN2MOE),
    "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE),
}
# One expert's part, as transformers saves it: `model.layers.3.mlp.experts.5.gate_proj.weight`.
EXPERT_PART = re.compile(r"(?P<mlp>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight")

TypeChooser = Callable[[str, tuple[int, ...]], gguf.GGMLQuantizationType]


def all_of(qtype: gguf.GGMLQuantizationType) -> TypeChooser:
    """Every matrix (and stack of experts' matrices) in `qtype`; vectors (norms, biases) in
    F32, as llama.cpp keeps them."""
    return lambda name, shape: qtype if len(shape) > 1 else F.F32


def k_quant_mix(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """Like llama.cpp's Q4_K_M: mostly Q4_K, v and down projections in Q6_K, the embedding in
    Q5_K, and Q8_0 where a row is not a whole number of 256-value super-blocks."""
    if len(shape) == 1:
        return F.F32
    if shape[-1] % 256:
        return F.Q8_0
    if "attn_v" in name or "ffn_down" in name:
        return F.Q6_K
    return F.Q5_K if name.startswith("token_embd") else F.Q4_K


def llama_q4_k_m(num_layers: int, tied_embedding: bool) -> TypeChooser:
    """llama.cpp's own Q4_K_M choices for a Qwen2 model: Q4_K, but Q6_K for the v and down
    projections of the first and last eighth of the layers and every third layer between,
    and for the vocabulary projection (the embedding, when it is tied to it)."""

    def more_bits(layer: int) -> bool:
        eighth = num_layers // 8
        return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2

    def choose(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
        if len(shape) == 1:
            return F.F32
        if name == "output.weight" or (tied_embedding and name == "token_embd.weight"):
            return F.Q6_K
        layer = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.", name)
        return F.Q6_K if layer and more_bits(int(layer.group(1))) else F.Q4_K

    return choose


def write_gguf(
    model_dir: str | Path,
    path: str | Path,
    choose_type: TypeChooser,
    architecture: str | None = None,
    pre_tokenizer: str = "gpt2",
    drop: tuple[str, ...] = (),
    seed: int = 0,
) -> str:
    """Write `model_dir`'s config, tokenizer, chat template and weights as one GGUF file.

    `architecture` overrides the one derived from the config (to write a file of an
    architecture nanoqwen does not run); tensors named in `drop` are left out. A sparse
    model's experts are stacked per layer and part (`blk.N.ffn_gate_exps.weight`
    `[E, rows, cols]`), as llama.cpp's converter writes them. The fixtures' tokenizer splits
    words like GPT-2, hence the "gpt2" pre-tokenizer; Qwen's own files say "qwen2".
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] not in ARCHITECTURES:
        raise ValueError(f"{model_dir}: no GGUF layout here for model type {config['model_type']!r}")
    arch_name, tensor_arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), architecture or arch_name)
    _add_model_metadata(writer, config)
    _add_tokenizer_metadata(writer, model_dir, pre_tokenizer)
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(tensor_arch, config["num_hidden_layers"])
    for hf_name, tensor in _stacked_tensors(model_dir / "model.safetensors"):
        base, suffix = hf_name.rsplit(".", 1)
        if names.get_name(base) is None:  # e.g. a dense layer in a Qwen2-MoE: llama.cpp has none
            raise ValueError(f"{hf_name} has no name in a GGUF file of {arch_name}")
        name = f"{names.get_name(base)}.{suffix}"
        if name in drop:
            continue
        weight = tensor.to(torch.float32).numpy()
        qtype = choose_type(name, weight.shape)
        try:
            data = gguf.quantize(weight, qtype)
        except NotImplementedError:
            data = random_blocks(weight, qtype, rng)
        # Quantized data is rows of bytes; the writer recovers the shape from its type.
        writer.add_tensor(name, data, raw_dtype=None if qtype in (F.F32, F.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _stacked_tensors(safetensors_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; each layer's experts, saved one tensor per expert
    and part, stacked into one tensor per part (`model.layers.N.mlp.experts.gate_proj.weight`)."""
    experts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    with safe_open(safetensors_path, framework="pt") as checkpoint:
        for name in sorted(checkpoint.keys()):
            match = EXPERT_PART.fullmatch(name)
            if match is None:
                yield name, checkpoint.get_tensor(name)
            else:
                stack = f"{match['mlp']}.{match['part']}.weight"
                experts[stack][int(match["expert"])] = checkpoint.get_tensor(name)
    for name, by_expert in sorted(experts.items()):
        yield name, torch.stack([by_expert[expert] for expert in range(len(by_expert))])


def random_blocks(
    weight: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Random blocks of `qtype`; for a k-quant, scaled to `weight`'s standard deviation."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (*weight.shape[:-1], -1)  # rows of bytes, as `gguf.quantize` returns them
    blocks = rng.integers(0, 256, size=(weight.size // block_size, type_size), dtype=np.uint8)
    if qtype not in K_QUANT_SCALES:
        return blocks.reshape(shape)
    d_offset, dmin_offset, dmin_ratio = K_QUANT_SCALES[qtype]

    def set_scales(d: float) -> None:
        for offset, value in ((d_offset, d), (dmin_offset, d * dmin_ratio)):
            if offset is not None:
                scale = np.full((len(blocks), 1), value, np.float16)
                blocks[:, offset : offset + 2] = scale.view(np.uint8)

    # Dequantized values are linear in the super-block scales: measure at 1, then rescale.
    set_scales(1.0)
    spread = gguf.dequantize(blocks.reshape(shape), qtype).std()
    set_scales(float(weight.std() / spread))
    return blocks.reshape(shape)


def _add_model_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] != "default":
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_experts") or config.get("num_local_experts")  # Qwen3-MoE: local
    if experts:  # as llama.cpp's converter writes a Qwen MoE's experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: Path, pre_tokenizer: str) -> None:
    """The byte-level BPE as llama.cpp stores it: tokens by id, their types, and merges."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = {index: token for token, index in tokenizer["model"]["vocab"].items()}
    special = {added["id"] for added in tokenizer["added_tokens"] if added["special"]}
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
    ids = range(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list([tokens[i] for i in ids])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in ids]
    )
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_content = {content: index for index, content in tokens.items()}
    writer.add_eos_token_id(by_content[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(by_content[tokenizer_config["pad_token"]])
    writer.add_bos_token_id(by_content[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())


@click.command()
@click.argument("preset_or_config")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def main(preset_or_config: str, path: Path) -> None:
    """Write random weights of PRESET_OR_CONFIG's shape as a Q4_K_M-like GGUF file at PATH."""
    model_dir = Path(random_checkpoint(preset_or_config))
    config = json.loads((model_dir / "config.json").read_text())
    mix = llama_q4_k_m(config["num_hidden_layers"], config["tie_word_embeddings"])
    write_gguf(model_dir, path, mix, pre_tokenizer="qwen2")  # a name llama.cpp knows
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
