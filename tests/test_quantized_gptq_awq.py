"""GPTQ and AWQ checkpoints: packed integer weights unpacked exactly, models that generate
like their dequantized selves, and clear errors for what is not supported.

`packed_checkpoints.py` quantizes and packs with its own numpy code, written from the
formats' descriptions, so these tests compare two independent readings of each layout.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import greedy, hf_greedy, random_prompts
from packed_checkpoints import Layout, pack, quantize, write_packed_checkpoint
from quantized_helpers import build_wide, largest_greedy_gap, quantized_llm
from safetensors.torch import load_file, save_file

from nanoqwen import LLM
from nanoqwen.weights.checkpoint import read_checkpoint
from nanoqwen.weights.formats import PackedWeights, WeightQuantization
from nanoqwen.weights.gptq_awq import dequantize
from nanoqwen.weights.quantization import tensor_bytes

LAYOUTS = {
    "gptq-int4-g128": Layout("gptq", 4, 128, symmetric=True),
    "gptq-int4-g32-act-order": Layout("gptq", 4, 32, act_order=True, symmetric=True),
    "gptq-int4-g64-v2-asymmetric": Layout("gptq", 4, 64, checkpoint_format="gptq_v2"),
    "gptq-int4-per-channel": Layout("gptq", 4, -1, symmetric=True),
    "gptq-int8-g128-act-order": Layout("gptq", 8, 128, act_order=True, symmetric=True),
    "gptq-int8-g32-v2-asymmetric": Layout("gptq", 8, 32, checkpoint_format="gptq_v2"),
    "awq-g128": Layout("awq", 4, 128),
    "awq-g64": Layout("awq", 4, 64),
    "awq-g32": Layout("awq", 4, 32),
}


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: build_wide(arch, tmp_path_factory.mktemp(arch)) for arch in ("qwen2", "qwen3")}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_unpacking_recovers_the_weights(layout: Layout) -> None:
    rng = np.random.default_rng(7)
    weight = rng.normal(0.0, 0.08, size=(48, 256)).astype(np.float32)
    quantized = quantize(weight, layout, rng)
    parts = {name: torch.from_numpy(value) for name, value in pack(quantized, layout).items()}
    unpacked = dequantize(parts, PackedWeights.from_hf(layout.quantization_config(), "test")).numpy()
    # Exactly the codes, zero points and scales the packer started from ...
    np.testing.assert_array_equal(unpacked, quantized.dequantized())
    # ... which are the original weights to within half a quantization step, plus the
    # float16 rounding of the step (relative 2**-11) times the largest code.
    assert np.all(np.abs(unpacked - weight) <= (0.5 + 2 ** (layout.bits - 11)) * quantized.step())


@pytest.mark.parametrize(
    "architecture, layout_name, default",
    [
        ("qwen2", "gptq-int4-g128", WeightQuantization("int4", 128)),
        ("qwen3", "gptq-int8-g128-act-order", WeightQuantization("int8")),
        ("qwen3", "awq-g64", WeightQuantization("int4", 64)),
    ],
)
def test_checkpoint_generates_like_its_dequantized_model(
    wide_dirs: dict[str, str], tmp_path: Path, architecture: str, layout_name: str, default: WeightQuantization
) -> None:
    packed_dir, dequantized_dir = write_packed_checkpoint(wide_dirs[architecture], tmp_path, LAYOUTS[layout_name])
    assert read_checkpoint(packed_dir).quantization == default
    llm = quantized_llm(packed_dir, "none")
    prompts = random_prompts(800, [6, 45], seed=31)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(8))):
        assert output.token_ids == hf_greedy(dequantized_dir, prompt, 8)


def test_int4_checkpoint_stays_int4_in_memory(wide_dirs: dict[str, str], tmp_path: Path) -> None:
    """By default a 4-bit checkpoint keeps 4-bit weights (bfloat16 has the int4 kernel).

    AWQ's groups span all 16 codes, so torchao's int4 grid for them is AWQ's own, up to the
    bfloat16 rounding of scales and zeros: the run-time model is the checkpoint's.
    """
    packed_dir, dequantized_dir = write_packed_checkpoint(wide_dirs["qwen3"], tmp_path, LAYOUTS["awq-g128"])
    llm = LLM(packed_dir, device="cpu", dtype="bfloat16", num_pages=64)
    for layer in llm.engine.runner.model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            # Half a byte per weight, plus a bfloat16 scale and zero per group of 128.
            weights = linear.weight.numel()
            assert tensor_bytes(linear.weight) == weights // 2 + weights // 128 * 4
    prompts = random_prompts(800, [6, 45], seed=32)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(12))):
        # bfloat16 arithmetic may break near-ties differently from the float32 dequantized
        # model (by up to ~0.13 here); a coarser grid would miss by up to ~1.
        assert largest_greedy_gap(dequantized_dir, prompt, output.token_ids) <= 0.3


def with_quantization_config(source: str, destination: Path, quantization_config: dict) -> str:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (destination / "config.json").write_text(json.dumps(config))
    return str(destination)


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "only AWQ's GEMM layout"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "unsupported GPTQ checkpoint_format 'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "unsupported gptq group_size 0"),
    ],
    ids=["bitsandbytes", "gptq-3bit", "awq-gemv", "gptq-marlin", "group-size-0"],
)
def test_unsupported_quantization_is_named(qwen2_dir: str, tmp_path: Path, quantization_config: dict, message: str) -> None:
    model_dir = with_quantization_config(qwen2_dir, tmp_path / "model", quantization_config)
    with pytest.raises(ValueError, match=rf"{model_dir}/config\.json: {message}"):
        LLM(model_dir, device="cpu")


def test_missing_scales_are_named(wide_dirs: dict[str, str], tmp_path: Path) -> None:
    packed_dir, _ = write_packed_checkpoint(wide_dirs["qwen2"], tmp_path, LAYOUTS["awq-g128"])
    weights = Path(packed_dir) / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.mlp\.down_proj\.scales'"):
        LLM(packed_dir, device="cpu")
