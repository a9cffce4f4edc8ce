"""Tensor parallelism on CPU processes (gloo): the same tokens as one device, and no
process left behind, whatever happens to the ranks.

Starting ranks costs seconds (each is a fresh Python importing torch), so the tests share
engines: `engines` keeps one tensor-parallel engine alive at a time (torch.distributed
allows one per process) and shuts it down before starting the next; the last test of
each setup kills a rank.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import profiled_ranks
import psutil
import pytest
import torch
from oracle import greedy, random_prompts
from packed_checkpoints import Layout, write_packed_checkpoint
from safetensors.torch import load_file, save_file
from server_helpers import wait_until
from torch.distributed.run import main as torchrun

from nanoqwen import LLM, SamplingParams, StepError
from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.memory.state_pool import lay_out_states
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import TensorParallel, split_across
from nanoqwen.model.loading import TensorSlice
from nanoqwen.parallel import launch
from nanoqwen.parallel.launch import check_splittable_shape
from nanoqwen.parallel.step_broadcast import STEP_WIRE, step_from_wire, step_to_wire
from nanoqwen.parallel.workers import WorkerFailure
from nanoqwen.runner import startup
from nanoqwen.runner.runner import StepInputs, lay_out
from nanoqwen.scheduling.request import Request
from nanoqwen.scheduling.scheduler import Row
from nanoqwen.weights.checkpoint import read_checkpoint
from nanoqwen.weights.loader import load_model, map_safetensors
from nanoqwen.weights.quantization import weight_memory_bytes
from tools.checkpoints import build_qwen2
from tools.gguf_files import F, all_of, write_gguf

VOCAB = 800
# Small pages, a small pool, small chunks and few sequences at a time: prefills are
# chunked, requests are preempted, and later prompts find earlier ones in the cache.
# Decode steps are padded to buckets through the CUDA-graph runner's buffers, as on a GPU.
OPTIONS = dict(
    device="cpu", page_size=4, num_pages=24, chunk_size=16, max_num_seqs=3, decode_buckets=[1, 2, 4]
)
REPO = Path(__file__).resolve().parents[1]


# Children that live as long as the test process, whatever the engines do:
# multiprocessing's resource tracker, and the grammar sandbox's worker (one per process,
# started by whichever earlier test in this process compiled a grammar).
LIFELONG_CHILDREN = ("resource_tracker", "nanoqwen.sampling.grammar_worker")


def helper_processes() -> set[int]:
    """Our child processes, but for the lifelong ones, and their own children."""
    lifelong = [child for child in psutil.Process().children()
                if any(name in " ".join(child.cmdline()) for name in LIFELONG_CHILDREN)]
    theirs = {process.pid for child in lifelong
              for process in [child, *child.children(recursive=True)]}
    return {child.pid for child in psutil.Process().children(recursive=True)} - theirs


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.05)
    pytest.fail(f"processes {alive} outlived their engine")


class Engines:
    """One live tensor-parallel engine at a time, reused by the tests that want it."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.llm: LLM | None = None

    def get(self, model_dir: str, size: int) -> LLM:
        """The engine splitting `model_dir` over `size` ranks."""
        if self.key != (model_dir, size):
            self.close()
            self.llm = LLM(model_dir, tensor_parallel_size=size, **OPTIONS)
            self.key = (model_dir, size)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            pids = self.llm.engine.workers.pids
            self.llm.shutdown()
            assert_gone(pids)
            self.llm = self.key = None


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    engines = Engines()
    yield engines
    engines.close()
    assert helper_processes() == set()


@pytest.fixture(autouse=True)
def no_stray_processes(engines: Engines) -> Iterator[None]:
    """After every test, our only children are the live shared engine's workers."""
    yield
    shared = set(engines.llm.engine.workers.pids) if engines.llm is not None else set()
    assert helper_processes() == shared


@pytest.fixture(scope="module")
def six_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six query heads and one KV head, so three ranks share (replicate) the KV head; the
    vocabulary (800) does not divide by three, so the last rank's rows are padded."""
    return build_qwen2(
        tmp_path_factory.mktemp("six-heads"), hidden_size=96, num_attention_heads=6,
        num_key_value_heads=1, intermediate_size=192,
    )


# Module-scoped, so that pytest runs all the tests of one setup before the next.
@pytest.fixture(
    scope="module",
    params=[("qwen2_dir", 2), ("qwen3_dir", 2), ("six_heads_dir", 3)],
    ids=["qwen2-tp2", "qwen3-tp2", "six-heads-tp3"],
)
def setup(request: pytest.FixtureRequest) -> tuple[str, int]:
    name, size = request.param
    return request.getfixturevalue(name), size


@pytest.fixture(scope="module")
def one_device() -> Callable[[str], LLM]:
    """The same settings on one device, one engine per model."""
    llms: dict[str, LLM] = {}
    return lambda model_dir: llms.setdefault(model_dir, LLM(model_dir, **OPTIONS))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prefix = random_prompts(VOCAB, [20], seed=40)[0]
    prompts = [prefix + tail for tail in random_prompts(VOCAB, [3, 9, 14], seed=41)]
    prompts += random_prompts(VOCAB, [37, 5, 26], seed=42) + [prefix + [1, 2, 3]]
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(3)]
    return prompts, [greedy(12)] * 4 + seeded


@pytest.mark.slow
def test_same_tokens_as_one_device(
    setup: tuple[str, int], engines: Engines, one_device: Callable[[str], LLM]
) -> None:
    model_dir, size = setup
    prompts, params = workload()
    expected = one_device(model_dir).generate(prompts, params)
    split = engines.get(model_dir, size)
    outputs = split.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.num_cached_tokens for o in outputs] == [o.num_cached_tokens for o in expected]
    stats = split.stats()
    # all in the mix
    assert stats["requests"]["preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["kv_cache"]["pages_used"] == 0


def test_logprobs_match_one_device(
    setup: tuple[str, int], engines: Engines, one_device: Callable[[str], LLM]
) -> None:
    """Prompt rows to score travel with the sampled rows to every rank; rank 0 scores them.
    Embeddings are refused: a pooled step would run eagerly while other ranks might not."""
    model_dir, size = setup
    prompts = workload()[0][:3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    expected = one_device(model_dir).generate(prompts, params)
    split = engines.get(model_dir, size)
    outputs = split.generate(prompts, params)
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        pairs = list(zip(got.logprobs + got.prompt_logprobs[1:],
                         want.logprobs + want.prompt_logprobs[1:]))
        assert len(pairs) == len(got.token_ids) + len(got.prompt_token_ids) - 1
        assert [a.top[0][0] for a, _ in pairs] == [b.top[0][0] for _, b in pairs]
        assert [a.logprob for a, _ in pairs] == pytest.approx([b.logprob for _, b in pairs],
                                                              abs=1e-4)
    with pytest.raises(ValueError, match="embeddings need one rank"):
        split.embed("hello")


def test_first_step_logits_match_one_device(
    setup: tuple[str, int], engines: Engines, one_device: Callable[[str], LLM]
) -> None:
    model_dir, size = setup
    prompts = random_prompts(VOCAB, [1, 5, 9], seed=43)  # one step: within chunk_size
    expected = first_step_logits(one_device(model_dir), prompts)
    logits = first_step_logits(engines.get(model_dir, size), prompts)
    assert logits.shape == (len(prompts), VOCAB)
    # The all-reduces add partial sums in another order than one matmul does.
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_memory_counts_the_weights_of_every_rank(
    setup: tuple[str, int], engines: Engines, one_device: Callable[[str], LLM]
) -> None:
    """Every rank holds a slice of the same size; the norms (and a KV head several ranks
    share) are whole on each, so the slices add up to more than the whole model."""
    model_dir, size = setup
    split = engines.get(model_dir, size)
    weights = split.stats()["memory"]["weight_bytes"]
    assert weights == size * weight_memory_bytes(split.engine.runner.model)
    assert weights > one_device(model_dir).stats()["memory"]["weight_bytes"]


def first_step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    engine = llm.engine
    ids = [engine.add_request(prompt, greedy(1)) for prompt in prompts]
    rows = engine.scheduler.schedule().rows
    logits = engine.runner.forward(engine.runner.prepare(rows))
    for request_id in ids:
        engine.abort(request_id)
    return logits


def test_the_start_up_profile_runs_on_every_rank(
    qwen3_dir: str, engines: Engines, one_device: Callable[[str], LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU, each rank's start-up runs the worst step (and the largest graph bucket's)
    through its runner to size the KV cache; every rank must get through it in step with
    the others, rank 0 sampling and the others not. Here the same profile runs inside the
    real start-up of two CPU ranks (`profiled_ranks.py`); afterwards they serve as usual."""
    engines.close()  # one split engine per process at a time
    monkeypatch.setattr(launch, "start_rank_runner", profiled_ranks.start_rank_runner)
    monkeypatch.setattr(startup, "cache_memory", profiled_ranks.profiling(startup.cache_memory))
    monkeypatch.setattr(profiled_ranks, "PROFILED", [])
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        assert len(profiled_ranks.PROFILED) == 1  # rank 0's; rank 1 ran its own beside it
        prompts, params = workload()
        expected = one_device(qwen3_dir).generate(prompts, params)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [
            o.token_ids for o in expected
        ]
    finally:
        pids = llm.engine.workers.pids
        llm.shutdown()
        assert_gone(pids)


def test_ctrl_c_lands_after_the_step_and_the_ranks_stay_in_step(
    setup: tuple[str, int], engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engines.get(*setup)
    prompts, params = workload()
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    forward = runner.model.forward

    def interrupted(*args: object) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGINT)  # arrives before this rank's all-reduces
        return forward(*args)

    monkeypatch.setattr(runner.model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    monkeypatch.undo()
    assert llm.engine.workers.failure is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_a_worker_killed_mid_step_fails_the_engine_within_seconds(
    setup: tuple[str, int], engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last test of each setup: it ends the engine."""
    llm = engines.get(*setup)
    workers = llm.engine.workers
    pids = workers.pids
    runner = llm.engine.runner
    forward = runner.model.forward

    def killing(*args: object) -> torch.Tensor:
        os.kill(pids[-1], signal.SIGKILL)  # the other ranks are running this step too
        return forward(*args)

    monkeypatch.setattr(runner.model, "forward", killing)
    prompts, params = workload()
    for _ in range(2):  # the step the rank dies in, and any step after it
        start = time.monotonic()
        with pytest.raises(StepError) as raised:
            llm.generate(prompts, params)
        assert time.monotonic() - start < 10  # a hang would take COLLECTIVE_TIMEOUT
        failure = raised.value.__cause__
        assert isinstance(failure, WorkerFailure)
        assert f"worker {len(pids)} (pid {pids[-1]}) was killed by SIGKILL" in str(failure)
    assert llm.stats()["requests"]["running"] == llm.stats()["requests"]["waiting"] == 0
    # The other workers failed in the same step, or exit once rank 0's ends of their
    # stdin close.
    for process in workers.processes:
        process.stdin.close()
    assert_gone(pids, within=5)
    engines.close()


@pytest.mark.parametrize("model", ["qwen2_dir", "qwen3_dir"])
def test_three_ranks_cannot_split_four_heads(model: str, request: pytest.FixtureRequest) -> None:
    """Refused before any process starts (the autouse check sees no child)."""
    message = "tensor_parallel_size=3 must divide the model's 4 attention heads"
    with pytest.raises(ValueError, match=message):
        LLM(request.getfixturevalue(model), device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize(("size", "shape", "message"), [
    (4, {"num_heads": 8, "num_kv_heads": 6}, "the model's 6 key/value heads or be a multiple"),
    (4, {"num_heads": 8, "num_kv_heads": 3}, "the model's 3 key/value heads or be a multiple"),
    (2, {"intermediate_size": 129}, "intermediate_size=129"),
])
def test_shapes_that_do_not_split_are_named(
    size: int, shape: dict, message: str, qwen2_dir: str
) -> None:
    config = dataclasses.replace(read_checkpoint(qwen2_dir).model_config, **shape)
    with pytest.raises(ValueError, match=message):
        check_splittable_shape(
            config.num_heads, config.num_kv_heads, config.intermediate_size, size
        )


@pytest.mark.parametrize("kind", ["gguf", "gptq", "int8 at run time"])
def test_quantized_weights_are_refused_before_any_process_starts(
    kind: str, qwen2_dir: str, tmp_path: Path
) -> None:
    """Ranks read slices of plain safetensors tensors: GGUF blocks and GPTQ packing do not
    slice that way, and quantizing each rank's slices is not supported yet."""
    options: dict = {}
    if kind == "gguf":
        model = write_gguf(qwen2_dir, tmp_path / "model.gguf", all_of(F.Q8_0))
        message = "a GGUF checkpoint"
    elif kind == "gptq":
        layout = Layout("gptq", 4, 32, symmetric=True)
        model, _ = write_packed_checkpoint(qwen2_dir, tmp_path, layout)
        message = "a GPTQ checkpoint"
    else:
        model, options, message = qwen2_dir, {"quantization": "int8"}, "quantization='int8'"
    with pytest.raises(ValueError, match=message):
        LLM(model, device="cpu", tensor_parallel_size=2, **options)


@pytest.mark.parametrize(
    ("model", "size"), [("qwen2_dir", 2), ("qwen3_dir", 4), ("six_heads_dir", 3)]
)
def test_each_rank_reads_only_its_slice_of_the_checkpoint(
    model: str, size: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
    weights_as_loaded: None,
) -> None:
    """Loading needs no other rank: every rank's weights, loaded alone, are the slices of
    the full model's, and the loader reads nothing more than those slices."""
    model_dir = request.getfixturevalue(model)
    checkpoint = read_checkpoint(model_dir)
    config = checkpoint.model_config
    full = load_model(checkpoint, torch.float32, torch.device("cpu"))
    monkeypatch.setattr("nanoqwen.weights.loader.map_safetensors", map_counting_slices)
    for rank in range(size):
        CountingSlice.elements_read = 0
        tp = TensorParallel(rank, size)
        with split_across(tp):
            shard = load_model(checkpoint, torch.float32, torch.device("cpu"))
        params = dict(shard.named_parameters())
        for name, tensor in params.items():
            expected = expected_slice(name, full, config, tp)
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
        start, rows = tp.vocab_shard(config.vocab_size)
        padding = (rows - min(rows, config.vocab_size - start)) * config.hidden_size
        tied = config.tie_word_embeddings
        kept = sum(p.numel() for p in params.values())
        assert CountingSlice.elements_read == kept - padding * (1 if tied else 2)


def map_counting_slices(path: str) -> tuple[mmap.mmap, dict[str, CountingSlice]]:
    """`map_safetensors` whose tensors a loader can only index, counting what it reads."""
    mapping, tensors = map_safetensors(path)
    return mapping, {name: CountingSlice(tensor) for name, tensor in tensors.items()}


class CountingSlice:
    """A checkpoint tensor that counts the elements it is indexed for."""

    elements_read = 0

    def __init__(self, source: TensorSlice) -> None:
        self.source = source

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        tensor = self.source[index]
        CountingSlice.elements_read += tensor.numel()
        return tensor


def expected_slice(
    name: str, full: torch.nn.Module, config: ModelConfig, tp: TensorParallel
) -> torch.Tensor:
    """Rank `tp.rank`'s part of the full model's parameter `name`, worked out from head
    and channel numbers (not from the loader's code)."""
    weight = dict(full.named_parameters())[name]
    head_dim, size, rank = config.head_dim, tp.size, tp.rank
    if "qkv_proj" in name:
        q_heads = config.num_heads // size
        kv_heads = max(1, config.num_kv_heads // size)
        kv_first = rank * config.num_kv_heads // size
        q, k, v = weight.split([config.num_heads * head_dim, *[config.num_kv_heads * head_dim] * 2])
        return torch.cat([
            q[rank * q_heads * head_dim:][: q_heads * head_dim],
            k[kv_first * head_dim:][: kv_heads * head_dim],
            v[kv_first * head_dim:][: kv_heads * head_dim],
        ])
    if "o_proj" in name:
        width = config.num_heads // size * head_dim
        return weight[:, rank * width:][:, :width]
    if "gate_up_proj" in name:
        gate, up = weight.chunk(2)
        width = config.intermediate_size // size
        return torch.cat([gate[rank * width:][:width], up[rank * width:][:width]])
    if "down_proj" in name:
        width = config.intermediate_size // size
        return weight[:, rank * width:][:, :width]
    if "embed_tokens" in name or "lm_head" in name:
        rows = -(-config.vocab_size // size)
        part = weight[rank * rows:][:rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return weight  # norms, Qwen3's q/k norms included, are the same on every rank


@pytest.mark.parametrize("with_states", [False, True], ids=["paged-only", "with-state-slots"])
def test_step_broadcast_carries_everything_the_model_reads(with_states: bool) -> None:
    """Every tensor of a step crosses to the other ranks, and arrives equal; what stays on
    rank 0 is its bookkeeping (which requests the rows are), never a tensor. A model with
    recurrent layers also sends each row's state slot and the copies around the forward."""
    request = Request("r", list(range(9)), greedy(1), pages=[1, 2, 3])
    slots = {"state_slot": 3, "state_source": 5, "state_save": 7} if with_states else {}
    inputs = lay_out([Row(request, 0, request.token_ids, 1, **slots)], 4, torch.device("cpu"),
                     pad_to=2)
    if with_states:
        inputs.states = lay_out_states([Row(request, 0, request.token_ids, 1, **slots)], 2)
    wire = step_to_wire(inputs)
    assert set(wire.tensors) == set(STEP_WIRE.tensor_names)
    assert set(wire.ints) == set(STEP_WIRE.int_names)
    received = step_from_wire(wire)
    for field in StepInputs.__dataclass_fields__:
        if field == "metadata":
            continue
        mine, theirs = getattr(inputs, field), getattr(received, field)
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs), field
        elif field in ("bucket", "num_sampled"):
            assert mine == theirs, field
        elif field == "states":
            assert (mine is None) == (theirs is None) == (not with_states)
            if with_states:
                assert theirs.query_lens == mine.query_lens == [9, 1]
                for part in ("slots", "copies_before", "copies_after"):
                    assert torch.equal(getattr(mine, part), getattr(theirs, part)), part
        else:
            assert field in ("sampled", "extra"), field  # rank 0's bookkeeping
    assert received.bucket == inputs.bucket == 2
    for field in AttentionMetadata.__dataclass_fields__:
        mine, theirs = getattr(inputs.metadata, field), getattr(received.metadata, field)
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs), field
        else:
            assert mine == theirs, field


def test_a_checkpoint_that_fails_to_load_fails_every_rank_cleanly(
    qwen2_dir: str, tmp_path: Path, engines: Engines
) -> None:
    engines.close()  # one split engine per process at a time
    broken = tmp_path / "broken"
    shutil.copytree(qwen2_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.mlp.down_proj.weight'"):
        LLM(str(broken), device="cpu", tensor_parallel_size=2)
    # (The autouse check: the worker that failed alike is gone too.)


def test_workers_exit_by_themselves_when_rank_zero_is_gone(
    qwen2_dir: str, engines: Engines
) -> None:
    """However rank 0 ends (SIGTERM, SIGKILL, a crash), its end of a worker's stdin closes,
    and that is all a worker needs to notice: here it closes while rank 0 lives on."""
    llm = engines.get(qwen2_dir, 2)
    workers = llm.engine.workers
    (worker,) = workers.processes
    worker.stdin.close()
    wait_until(lambda: worker.poll() is not None, timeout=5)
    assert worker.returncode == 1  # its own exit, not our terminate
    start = time.monotonic()
    with pytest.raises(StepError) as raised:
        llm.generate(*workload())
    assert time.monotonic() - start < 10  # fails before sending anything
    assert f"worker 1 (pid {worker.pid}) exited with code 1" in str(raised.value.__cause__)
    engines.close()


@pytest.mark.slow
def test_torchrun_runs_the_same_script_on_every_rank(
    qwen3_dir: str, tmp_path: Path, one_device: Callable[[str], LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """env:// rendezvous: rank 0 generates, rank 1 serves inside `LLM(...)` and exits when
    rank 0 does (here, at its exit, without an explicit shutdown). torchrun's launcher
    runs in this process, which spares starting one more interpreter."""
    result = tmp_path / "tokens.json"
    script = tmp_path / "generate.py"
    script.write_text(
        "import json\n"
        "from nanoqwen import LLM\n"
        "from oracle import greedy, random_prompts\n"
        f"llm = LLM({qwen3_dir!r}, tensor_parallel_size=2, **{OPTIONS!r})\n"
        f"prompts = random_prompts({VOCAB}, [5, 30], seed=44)\n"
        "outputs = llm.generate(prompts, greedy(8))\n"
        f"open({str(result)!r}, 'w').write(json.dumps([o.token_ids for o in outputs]))\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{REPO / 'tests'}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun would set, here and for good
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        torchrun(["--standalone", "--nproc-per-node", "2", str(script)])
    finally:
        for sig, handler in handlers.items():  # the launcher installs its own
            signal.signal(sig, handler)
    expected = one_device(qwen3_dir).generate(random_prompts(VOCAB, [5, 30], seed=44), greedy(8))
    assert json.loads(result.read_text()) == [o.token_ids for o in expected]


SCRIPT_WITHOUT_MAIN_GUARD = """
from nanoqwen import LLM
from oracle import greedy, random_prompts
llm = LLM({model!r}, tensor_parallel_size=2, **{options!r})
print("tokens", [o.token_ids for o in llm.generate(random_prompts({vocab}, [6, 17], seed=5), greedy(6))])
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a script", "stdin", "-c"])
def test_workers_never_import_the_callers_main_module(
    how: str, qwen2_dir: str, tmp_path: Path, one_device: Callable[[str], LLM]
) -> None:
    """Workers are their own entry point: a script without an `if __name__ == "__main__":`
    guard, a script piped on stdin and `python -c` all run a split model (and leave no
    worker behind: the autouse check)."""
    code = SCRIPT_WITHOUT_MAIN_GUARD.format(model=qwen2_dir, options=OPTIONS, vocab=VOCAB)
    script = tmp_path / "generate.py"
    script.write_text(code)
    command = {"a script": [str(script)], "stdin": ["-"], "-c": ["-c", code]}[how]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    result = subprocess.run(
        [sys.executable, *command], input=code if how == "stdin" else None, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    expected = one_device(qwen2_dir).generate(random_prompts(VOCAB, [6, 17], seed=5), greedy(6))
    assert result.stdout.strip() == f"tokens {[o.token_ids for o in expected]}"
