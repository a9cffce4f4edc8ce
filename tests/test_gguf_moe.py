"""Mixture-of-experts GGUF files (llama.cpp's `qwen2moe`, `qwen3moe`); hybrid ones refused.

The files are written by the `gguf` package from tiny transformers checkpoints, each
layer's experts stacked per part as llama.cpp's converter stacks them
(`tools/gguf_files.py`). transformers cannot be the oracle here as it is for dense files: it
reads no expert widths from a MoE file. The oracle is the checkpoint the file was written
from, with every matrix rounded through the file's type (`gguf.quantize`, then
`gguf.dequantize`): the weights the file holds, run by transformers.
"""

from pathlib import Path

import gguf
import pytest
import torch
from oracle import greedy, hf_greedy, hf_model, random_prompts

from nanoqwen import LLM
from nanoqwen.model.moe import ReplicatedLinear
from nanoqwen.weights.checkpoint import read_checkpoint
from nanoqwen.weights.formats import WeightQuantization
from nanoqwen.weights.quantization import Int4Linear
from tools.checkpoints import build_qwen2_moe
from tools.gguf_files import F, all_of, write_gguf

PROMPT_LENGTHS = [5, 19, 33]


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def moe_dir(
    request: pytest.FixtureRequest, newer_kind_dirs: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    if request.param == "qwen3_moe":
        return newer_kind_dirs["qwen3_moe"]
    # llama.cpp's Qwen2-MoE has no dense layers, and Q8_0 wants rows of whole 32-value blocks.
    directory = tmp_path_factory.mktemp("qwen2_moe_gguf")
    return build_qwen2_moe(directory, mlp_only_layers=[], shared_expert_intermediate_size=64)


def rounded_checkpoint(model_dir: str, qtype: gguf.GGMLQuantizationType, directory: Path) -> str:
    """`model_dir`'s model with every matrix (experts' stacks too) as a `qtype` file holds it."""
    model = hf_model(model_dir)
    rounded = type(model)(model.config).eval()
    with torch.no_grad():
        for name, param in model.state_dict().items():
            value = param.numpy()
            if param.dim() > 1:
                value = gguf.dequantize(gguf.quantize(value, qtype), qtype)
            rounded.get_parameter(name).copy_(torch.from_numpy(value))
    rounded.save_pretrained(directory)
    return str(directory)


def test_a_moe_file_runs_like_the_checkpoint_it_was_written_from(moe_dir: str, tmp_path: Path) -> None:
    path = write_gguf(moe_dir, tmp_path / "model.gguf", all_of(F.F32))
    ours, source = read_checkpoint(path).model_config, read_checkpoint(moe_dir).model_config
    assert (ours.architecture, ours.moe, ours.layer_kinds) == (source.architecture, source.moe, source.layer_kinds)
    prompts = random_prompts(800, PROMPT_LENGTHS, seed=41)
    outputs = LLM(path, device="cpu", num_pages=64).generate(prompts, greedy(10))
    assert [output.token_ids for output in outputs] == [hf_greedy(moe_dir, p, 10) for p in prompts]


@pytest.mark.parametrize("qtype", [F.Q8_0, F.Q4_0], ids=lambda qtype: qtype.name)
def test_a_quantized_moe_file_agrees_with_transformers_on_its_weights(
    moe_dir: str, tmp_path: Path, qtype: gguf.GGMLQuantizationType
) -> None:
    path = write_gguf(moe_dir, tmp_path / "model.gguf", all_of(qtype))
    oracle = rounded_checkpoint(moe_dir, qtype, tmp_path / "rounded")
    prompts = random_prompts(800, PROMPT_LENGTHS, seed=42)
    outputs = LLM(path, device="cpu", num_pages=64, quantization="none").generate(prompts, greedy(10))
    assert [output.token_ids for output in outputs] == [hf_greedy(oracle, p, 10) for p in prompts]


def test_a_4_bit_moe_file_keeps_its_codes_and_its_experts_weights(moe_dir: str, tmp_path: Path) -> None:
    """Followed on a CPU, a Q4_0 file keeps its own codes in the attention and the lm_head
    (`Int4Linear`); the experts and the router keep the file's weights, dequantized."""
    path = write_gguf(moe_dir, tmp_path / "model.gguf", all_of(F.Q4_0))
    assert read_checkpoint(path).quantization == WeightQuantization("int4", 32)  # experts counted
    llm = LLM(path, device="cpu", num_pages=64)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
    assert isinstance(layer.mlp.gate, ReplicatedLinear)
    stacked = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.0.ffn_down_exps.weight"]
    file_weights = torch.from_numpy(gguf.dequantize(stacked.data, stacked.tensor_type))
    assert torch.equal(layer.mlp.experts.down_proj.weight, file_weights)
    (output,) = llm.generate(random_prompts(800, [12], seed=43), greedy(6))
    assert len(output.token_ids) == 6


@pytest.mark.parametrize("architecture", ["qwen3next", "qwen35", "qwen35moe"])
def test_a_hybrid_file_is_refused_by_name(qwen2_dir: str, tmp_path: Path, architecture: str) -> None:
    path = write_gguf(qwen2_dir, tmp_path / f"{architecture}.gguf", all_of(F.F16), architecture=architecture)
    with pytest.raises(ValueError, match=rf"{architecture}\.gguf: GGUF architecture '{architecture}' is "
                                         "not supported: nanoqwen runs the hybrid"):
        LLM(path, device="cpu")


def test_a_dense_layer_has_no_place_in_a_qwen2moe_file(newer_kind_dirs: dict[str, str], tmp_path: Path) -> None:
    """The tests' Qwen2-MoE keeps layer 1 dense, which llama.cpp's Qwen2-MoE cannot hold."""
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has no name"):
        write_gguf(newer_kind_dirs["qwen2_moe"], tmp_path / "model.gguf", all_of(F.F32))
