"""bench.py --floor: the replay runs the engine's own token schedule, and the split adds up.

The schedule is checked against what the model itself saw: forward hooks on its dense
layers record the rows of every call while the engine runs, and again while the floor is
replayed, and the two records must be the same, step for step. No test looks at how fast
anything was.
"""

import json
from pathlib import Path

import pytest
import torch
from test_bench import TINY_SHAPE, run_bench

from nanoqwen import LLMEngine, SamplingParams
from tools.bench_decode import Observers, PhaseTimer, observe
from tools.bench_floor import (
    SPLIT,
    FloorRecorder,
    StepShape,
    measure_floor,
    replay_floor,
)


def dense_modules(engine: LLMEngine) -> dict[str, torch.nn.Module]:
    model = engine.runner.model
    first, last = model.model.layers[0], model.model.layers[-1]
    return {
        "embedding": model.model.embed_tokens,
        "qkv": first.self_attn.qkv_proj,
        "o": first.self_attn.o_proj,
        "gate_up": last.mlp.gate_up_proj,
        "down": last.mlp.down_proj,
        "lm_head": model.lm_head,
    }


def record_calls(modules: dict[str, torch.nn.Module]) -> tuple[list[tuple[str, int]], list]:
    """(module, rows of its input) for every call, in order; and the hooks to remove."""
    calls: list[tuple[str, int]] = []

    def hook(name: str):
        return lambda module, args, output: calls.append((name, args[0].shape[0]))

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    return calls, handles


def install(engine: LLMEngine) -> tuple[FloorRecorder, PhaseTimer]:
    recorder, timer = FloorRecorder(), PhaseTimer(engine.device)
    recorder.attach(engine)
    observe(engine, Observers(timer, recorder))
    return recorder, timer


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_runs_the_engines_schedule(model_dir: str, dtype: str) -> None:
    # Chunked prefills, decodes and steps mixing both; some steps sample nothing.
    engine = LLMEngine(model_dir, device="cpu", dtype=dtype, chunk_size=24, max_num_seqs=3)
    recorder, timer = install(engine)
    for length, max_tokens in ((40, 3), (7, 6), (19, 1), (30, 4), (3, 5)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(list(range(1, length + 1)), params)
    engine_calls, handles = record_calls(dense_modules(engine))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    for handle in handles:
        handle.remove()

    assert len(recorder.steps) == steps
    assert sum(step.num_sampled for step in recorder.steps) == 3 + 6 + 1 + 4 + 5
    assert any(step.num_sampled == 0 for step in recorder.steps)  # a mid-prompt chunk
    replay_calls, handles = record_calls(dense_modules(engine))
    replay_floor(engine.runner.model, recorder.steps)
    for handle in handles:
        handle.remove()
    assert replay_calls == engine_calls

    figures = measure_floor(engine, recorder, 1.0, timer.seconds)
    assert figures["steps"] == steps
    assert figures["tokens"] == sum(rows for name, rows in engine_calls if name == "embedding")
    assert figures["split"]["attention"] > 0  # the backend was timed inside the run


def test_padding_rows_stay_out_of_the_schedule(qwen3_dir: str) -> None:
    """With decode buckets the model computes padding rows; the floor counts real tokens."""
    engine = LLMEngine(qwen3_dir, device="cpu", decode_buckets=[4])
    recorder, _ = install(engine)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for length in (5, 9, 2):
        engine.add_request(list(range(1, length + 1)), params)
    engine_calls, handles = record_calls(dense_modules(engine))
    while engine.has_unfinished_requests():
        engine.step()
    for handle in handles:
        handle.remove()
    embedded = [rows for name, rows in engine_calls if name == "embedding"]
    assert embedded[1:] == [4, 4]  # two padded decode steps of three requests
    assert recorder.steps == [StepShape(16, 3), StepShape(3, 3), StepShape(3, 3)]


@pytest.mark.slow
def test_floor_figures_add_up(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_SHAPE))
    options = ["--num-seqs", "5", "--min-input", "5", "--max-input", "30",
               "--min-output", "2", "--max-output", "8", "--rounds", "3", "--floor"]
    result = run_bench(tmp_path, "--random-weights", str(config), *options)
    rounds = result["rounds"]["floor"]
    assert len(rounds) == 3 and result["floor"] in rounds
    # The reported round is the one with the median ratio.
    assert result["floor"]["floor_ratio"] == sorted(r["floor_ratio"] for r in rounds)[1]
    for floor, engine in zip(rounds, result["rounds"]["nanoqwen"], strict=True):
        assert floor["engine_s"] == engine["wall_s"]
        assert floor["floor_s"] > 0
        assert floor["floor_ratio"] == pytest.approx(floor["engine_s"] / floor["floor_s"])
        split = floor["split"]
        assert set(split) == set(SPLIT) == set(floor["split_ratio"])
        assert floor["floor_s"] + sum(split.values()) == pytest.approx(floor["engine_s"])
        assert 1 + sum(floor["split_ratio"].values()) == pytest.approx(floor["floor_ratio"])
        phases = {name: phase["seconds"] for name, phase in engine["phases"].items()}
        assert split["sampling"] == pytest.approx(phases["sample"])
        bookkeeping = sum(phases[n] for n in ("schedule", "propose", "prepare", "postprocess"))
        assert split["bookkeeping"] == pytest.approx(bookkeeping + phases["outside steps"])
        assert 0 < split["attention"] < phases["forward"]
        assert floor["steps"] == engine["steps"]
        assert floor["sampled_rows"] == engine["output_tokens"]
        assert floor["tokens"] == engine["input_tokens"] + engine["output_tokens"] - 5
