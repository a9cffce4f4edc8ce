"""Weight-only quantization at run time: linear weights kept as int8 (on a CPU, torch's own
int8 kernel; the lm_head too) or int4 (through torchao).

Each quantized layer is checked against the quantization error its format allows, and the
engine's greedy output against full-precision transformers, up to near-ties: a token the
quantized model picks must be within a stated margin of the best full-precision logit.
The margins are measured on the fixtures with room to spare: int8 moves their logits by
at most ~0.05, and int4, which rounds each weight to one of 16 levels of its group, by up
to ~0.8 on these random weights (whose logits spread ~1.3).
"""

import logging

import click
import pytest
import torch
from click.testing import CliRunner
from oracle import greedy, hf_greedy, random_prompts
from quantized_helpers import largest_greedy_gap, quantized_llm
from torch import nn

from nanoqwen.cli import engine_options, pop_engine_options
from nanoqwen.config import EngineConfig
from nanoqwen.weights.checkpoint import read_checkpoint
from nanoqwen.weights.formats import WeightQuantization
from nanoqwen.weights.loader import load_model
from nanoqwen.weights.quantization import (
    Int8Linear,
    int4_group_size,
    tensor_bytes,
    weight_memory_bytes,
)

NEAR_TIE = {"int8": 0.1, "int4": 1.0}
CPU = torch.device("cpu")


def load(model_dir: str, dtype: torch.dtype, quantization: str) -> nn.Module:
    return load_model(read_checkpoint(model_dir), dtype, CPU, quantization)


def decoder_linears(model: nn.Module) -> list[nn.Module]:
    return [
        module for module in model.model.layers.modules()
        if isinstance(module, (nn.Linear, Int8Linear))
    ]


def quantized_bytes(linear: nn.Module) -> int:
    """What a layer's weight takes: an `Int8Linear`'s codes and scales, or its weight."""
    if isinstance(linear, Int8Linear):
        return tensor_bytes(linear.codes) + tensor_bytes(linear.scales)
    return tensor_bytes(linear.weight)


def is_quantized(linear: nn.Module) -> bool:
    return isinstance(linear, Int8Linear) or type(linear.weight) is not nn.Parameter


def error_bound(weight: torch.Tensor, x: torch.Tensor, mode: str, group_size: int) -> torch.Tensor:
    """What rounding each weight to its format's grid can change `x @ weight.T` by: 0.6 of a
    step per weight (half a step, plus the rounding of the scales and zero points)."""
    weight = weight.float()
    if mode == "int8":  # one symmetric scale per output row, 255 steps across ±max|w|
        step = (2 * weight.abs().amax(1, keepdim=True) / 255).expand_as(weight)
    else:  # a scale and a zero point per group: 15 steps from its minimum to its maximum
        groups = weight.view(weight.shape[0], -1, group_size)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(group_size, dim=1)
    return x.abs().float() @ (0.6 * step).t()


@pytest.mark.parametrize("mode, dtype", [("int8", torch.float32), ("int8", torch.bfloat16), ("int4", torch.bfloat16)])
def test_every_linear_layer_is_within_its_quantization_error(
    model_dir: str, mode: str, dtype: torch.dtype, weights_as_loaded: None
) -> None:
    dense, quantized = load(model_dir, dtype, "none"), load(model_dir, dtype, mode)
    generator = torch.Generator().manual_seed(0)
    group_size = int4_group_size(128, [layer.in_features for layer in decoder_linears(dense)])
    for reference, linear in zip(decoder_linears(dense), decoder_linears(quantized)):
        assert is_quantized(linear)  # an Int8Linear or a torchao tensor, not plain weights
        x = torch.randn(8, linear.in_features, generator=generator).to(dtype)
        with torch.inference_mode():
            exact = x.float() @ reference.weight.float().t()
            if linear.bias is not None:
                exact += linear.bias.float()
            error = (linear(x).float() - exact).abs()
        # bfloat16 outputs carry their own rounding, 2**-8 of their size.
        slack = 1e-5
        if dtype == torch.bfloat16:
            slack = 2**-7 * (x.abs().float() @ reference.weight.abs().float().t())
        assert torch.all(error <= error_bound(reference.weight, x, mode, group_size) + slack)


@pytest.mark.parametrize(
    "architecture, mode, dtype",
    [("qwen2", "int8", "float32"), ("qwen3", "int8", "bfloat16"), ("qwen2", "int4", "bfloat16"), ("qwen3", "int4", "bfloat16")],
)
def test_greedy_output_agrees_with_full_precision_up_to_near_ties(
    request: pytest.FixtureRequest, architecture: str, mode: str, dtype: str
) -> None:
    model_dir = request.getfixturevalue(f"{architecture}_dir")
    llm = quantized_llm(model_dir, mode, dtype=dtype)
    prompts = random_prompts(800, [5, 60], seed=41)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(12))):
        assert largest_greedy_gap(model_dir, prompt, output.token_ids) <= NEAR_TIE[mode]


def test_weights_take_the_bytes_their_format_says(qwen3_dir: str) -> None:
    config = read_checkpoint(qwen3_dir).model_config
    dense = load(qwen3_dir, torch.bfloat16, "none")
    # Every parameter once: the lm_head is the embedding (tied), counted once.
    assert weight_memory_bytes(dense) == 2 * sum(p.numel() for p in dense.parameters())
    assert config.tie_word_embeddings
    for mode, bytes_per_weight, overhead_per_row in (("int8", 1, 8), ("int4", 0.5, 4 * 128 // 64)):
        quantized = load(qwen3_dir, torch.bfloat16, mode)
        linears = decoder_linears(quantized)
        for linear in linears:
            rows, columns = linear.out_features, linear.in_features
            # The codes, plus per row a scale (and zero point) for int8, or a bfloat16
            # scale and zero per group of 64 (128 inputs: 2 groups) for int4.
            codes = rows * columns * bytes_per_weight
            assert codes <= quantized_bytes(linear) <= codes + rows * overhead_per_row
        saved = sum(2 * linear.in_features * linear.out_features - quantized_bytes(linear)
                    for linear in linears)
        # On a CPU, int8 keeps an int8 lm_head beside the (tied) embedding.
        head = quantized_bytes(quantized.lm_head) if mode == "int8" else 0
        assert weight_memory_bytes(quantized) == weight_memory_bytes(dense) - saved + head


def test_int4_group_size_divides_every_layer() -> None:
    assert int4_group_size(128, [256, 512]) == 128
    assert int4_group_size(128, [64, 128]) == 64
    assert int4_group_size(32, [256]) == 32
    assert int4_group_size(128, [256, 48]) is None


def test_int4_in_float32_warns_once_and_keeps_full_weights(qwen2_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nanoqwen.weights.quantization"):
        llm = quantized_llm(qwen2_dir, "int4")
    assert [record.getMessage() for record in caplog.records] == [
        "int4 weight-only matmuls are fast only in bfloat16, not float32 (run in bfloat16: "
        "dtype='bfloat16', or --dtype bf16 on the command line); "
        "keeping the linear weights in float32"
    ]
    assert all(type(linear.weight) is nn.Parameter for linear in decoder_linears(llm.engine.runner.model))
    prompt = random_prompts(800, [20], seed=42)[0]
    assert llm.generate([prompt], greedy(10))[0].token_ids == hf_greedy(qwen2_dir, prompt, 10)


def test_a_missing_kernel_falls_back_to_full_weights_with_one_warning(
    qwen3_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torchao.quantization import Int4WeightOnlyConfig

    # tinygemm's CUDA layout: quantizing for it on the CPU fails for want of its kernel.
    cuda_only = Int4WeightOnlyConfig(group_size=64, int4_packing_format="tile_packed_to_4d", set_inductor_config=False)
    monkeypatch.setattr("nanoqwen.weights.quantization.torchao_config", lambda *args: (cuda_only, ""))
    with caplog.at_level(logging.WARNING, logger="nanoqwen.weights.quantization"):
        model = load(qwen3_dir, torch.bfloat16, "int4")
    assert len(caplog.records) == 1
    assert "int4 weight-only quantization failed for 8 of 8 linear layers" in caplog.records[0].getMessage()
    dense = load(qwen3_dir, torch.bfloat16, "none")
    for reference, linear in zip(decoder_linears(dense), decoder_linears(model)):
        assert type(linear.weight) is nn.Parameter and torch.equal(linear.weight, reference.weight)


def test_quantization_option_reaches_the_engine_config() -> None:
    @click.command()
    @engine_options
    def command(**options) -> None:
        click.echo(repr(pop_engine_options(options)))

    result = CliRunner().invoke(command, ["--quantization", "int4", "--device", "cpu"])
    assert result.exit_code == 0 and "'quantization': 'int4'" in result.output
    assert "'quantization'" not in CliRunner().invoke(command, []).output  # default: the checkpoint's
    rejected = CliRunner().invoke(command, ["--quantization", "fp8"])
    assert rejected.exit_code == 2 and "'fp8' is not one of 'none', 'int8', 'int4'" in rejected.output
    with pytest.raises(ValueError, match="unknown quantization 'fp8': use one of none, int8, int4"):
        EngineConfig(model="m", device="cpu", quantization="fp8")
    assert WeightQuantization("int4").group_size == 128
