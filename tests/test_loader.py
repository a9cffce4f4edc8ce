"""Loading checkpoints: fused weights, shards, hub-id resolution, rope scaling, and clear errors."""

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from oracle import greedy, hf_greedy, hf_last_logits, random_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanoqwen import LLM
from nanoqwen.weights import loader
from nanoqwen.weights.checkpoint import read_checkpoint, resolve_model_path
from nanoqwen.weights.loader import iter_checkpoint, load_model
from tools.checkpoints import build_qwen2, build_qwen3


def copy_checkpoint(source: str, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_fused_parameters_hold_the_checkpoint_blocks(model_dir: str, weights_as_loaded: None) -> None:
    checkpoint = read_checkpoint(model_dir)
    config = checkpoint.model_config
    model = load_model(checkpoint, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    q, k, v = ours.self_attn.qkv_proj.weight.split(
        [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
    )
    torch.testing.assert_close(q, theirs.self_attn.q_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(k, theirs.self_attn.k_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(v, theirs.self_attn.v_proj.weight, rtol=0, atol=0)
    gate, up = ours.mlp.gate_up_proj.weight.chunk(2)
    torch.testing.assert_close(up, theirs.mlp.up_proj.weight, rtol=0, atol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings


def test_the_load_reports_each_tensor_in_order(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command line's progress hook sees 1..total, total the checkpoint's tensors."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(loader, "on_tensor_loaded", lambda done, total: seen.append((done, total)))
    checkpoint = read_checkpoint(model_dir)
    load_model(checkpoint, torch.float32, torch.device("cpu"))
    total = sum(1 for _ in iter_checkpoint(checkpoint.path, checkpoint.packed))
    assert seen == [(done, total) for done in range(1, total + 1)]


def test_sharded_checkpoint_loads(qwen2_dir: str, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    sharded = copy_checkpoint(qwen2_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    hf.save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompt = random_prompts(800, [30], seed=11)[0]
    assert LLM(str(sharded), device="cpu").generate([prompt], greedy(8))[0].token_ids == hf_greedy(qwen2_dir, prompt, 8)


def test_missing_path_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model path not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_directory_without_config_says_what_to_pass(qwen2_dir: str, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(qwen2_dir, tmp_path / "weights-only")
    (model_dir / "config.json").unlink()
    expected = (
        f"no config.json in {model_dir}: pass a Qwen2/Qwen3 checkpoint directory, a .gguf file "
        "or a hub id"
    )
    with pytest.raises(ValueError) as raised:
        LLM(str(model_dir), device="cpu")
    assert str(raised.value) == expected


def test_unknown_hub_id_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not find model 'nobody/no-such-model'"):
        resolve_model_path("nobody/no-such-model")


def test_unsupported_architecture_names_the_supported_ones(qwen2_dir: str, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(qwen2_dir, tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(model_dir), device="cpu")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing weight 'model.layers.1.mlp.gate_up_proj.weight'"),
        (lambda t: t.pop("model.norm.weight"), "missing weight 'model.norm.weight'"),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), "unexpected weight 'model.layers.0.extra.weight'"),
        (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)}), "shape mismatch for weight 'model.layers.0.self_attn.k_proj.weight'"),
    ],
    ids=["missing-fused-block", "missing", "unexpected", "shape"],
)
def test_bad_weights_are_named(qwen2_dir: str, tmp_path: Path, edit, message: str) -> None:
    model_dir = copy_checkpoint(qwen2_dir, tmp_path / "bad")
    rewrite_weights(model_dir, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict) -> None:
    # A short trained context, so dynamic scaling kicks in inside a small test.
    model_dir = build_qwen3(tmp_path / "rope", rope_parameters=rope, max_position_embeddings=64)
    llm = LLM(model_dir, device="cpu", max_model_len=200)
    prompts = random_prompts(800, [20, 90], seed=12)
    outputs = llm.generate(prompts, greedy(12))
    for prompt, output in zip(prompts, outputs):
        torch.testing.assert_close(
            _first_logits(llm, prompt), hf_last_logits(model_dir, prompt), atol=1e-4, rtol=0
        )
        assert output.token_ids == hf_greedy(model_dir, prompt, 12)


def _first_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    request_id = engine.add_request(prompt, greedy(1))
    batch = engine.scheduler.schedule().rows
    logits = engine.runner.forward(engine.runner.prepare(batch))[0]
    engine.scheduler.advance(batch)
    engine.abort(request_id)
    return logits


def test_unsupported_rope_type_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = build_qwen2(tmp_path / "llama3")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    }
    (Path(model_dir) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'llama3'.*linear, dynamic, yarn"):
        LLM(model_dir, device="cpu")


def test_unreadable_config_is_a_clear_error(qwen2_dir: str, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(qwen2_dir, tmp_path / "broken")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not read the model config"):
        LLM(str(model_dir), device="cpu")


def test_loading_hands_back_each_tensors_file_pages(tmp_path: Path) -> None:
    """Pages of a memory-mapped file the loader has read count in the process's resident
    memory until they are unmapped: once a tensor is copied, the loader gives them back, so
    at most the tensor being copied is resident, never the file read so far."""
    tensors = {f"t{index}": torch.full((512, 512), float(index)) for index in range(8)}  # 1 MiB each
    save_file(tensors, tmp_path / "model.safetensors")
    tensor_kib = 512 * 512 * 4 // 1024
    most = 0
    for name, source in iter_checkpoint(str(tmp_path), None):
        torch.testing.assert_close(source[:].clone(), tensors[name], rtol=0, atol=0)
        most = max(most, resident_kib(tmp_path / "model.safetensors"))
    # The tensor being read, and what a fault maps around it: at most a 2 MiB page each side.
    assert 0 < most <= tensor_kib + 2 * 2048 < len(tensors) * tensor_kib


def resident_kib(path: Path) -> int:
    """How much of `path`, in KiB, this process's memory maps of it hold resident."""
    resident, in_file = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: its range and file
                in_file = fields[-1] == str(path)
            elif in_file and fields[0] == "Rss:":
                resident += int(fields[1])
    return resident


def test_a_weight_form_frees_each_weight_it_replaces(
    qwen2_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight form (oneDNN packing, int8) replaces the loaded weights one by one: the
    loader holds none of them meanwhile, so each replaced one is freed at once and memory
    never holds the model twice."""
    freed = []

    def replace_weights(model: torch.nn.Module, *unused: object) -> None:
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                loaded = weakref.ref(module.weight)
                module.weight = torch.nn.Parameter(module.weight.detach().clone())
                freed.append(loaded() is None)

    monkeypatch.setattr("nanoqwen.model.packed.pack_linear_weights", replace_weights)
    monkeypatch.setattr("nanoqwen.weights.loader.weight_form", lambda *unused: "onednn_packed")
    load_model(read_checkpoint(qwen2_dir), torch.float32, torch.device("cpu"))
    assert freed and all(freed)
