"""The CUDA path's host-side decisions, checked on the CPU.

flashinfer's kernels and CUDA graphs need a GPU (`test_cuda.py`, `test_cuda_flashinfer.py`),
but what surrounds them is plain Python and runs here against stand-ins
(`fake_flashinfer.py`: flashinfer's wrappers with its parameter names and its CUDA-graph
buffer contract, attending like the reference backend; events that log their calls):

* every flashinfer wrapper waits on its own event before `plan` and records it after;
* `FlashInferBackend` plans each kind of step into the right wrapper with the right page
  table, so an engine on the stand-ins gives exactly the reference backend's tokens;
* flashinfer counts as available only once the model's kernels are built and have run,
  under a status line, and a failed build falls back to the torch backend with one
  warning that names the cause;
* start-up and every step run with the model's device made current.
"""

import io
import logging
import re
import sys
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import fake_flashinfer
import pytest
import torch
from cuda_helpers import (
    FLASHINFER_DISABLE_JIT_SINCE,
    build_model_64,
    declared_flashinfer_range,
)
from fake_flashinfer import FakeDecodeWrapper, FakeEvent, FakePrefillWrapper
from oracle import greedy, random_prompts, run_to_completion
from rich.console import Console
from steps import step_of

import nanoqwen
from nanoqwen import LLMEngine
from nanoqwen.attention import flashinfer_backend as attention_flashinfer
from nanoqwen.attention import registry
from nanoqwen.attention.base import AttentionShape
from nanoqwen.attention.flashinfer_backend import (
    DECODE,
    PREFILL,
    FencedWrapper,
    FlashInferBackend,
    FlashInferFA2Backend,
    flashinfer_backend_for,
    flashinfer_unsupported_reason,
    warm_up_kernels,
)
from nanoqwen.attention.registry import attention_backend_class
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.config import RunnerSettings
from nanoqwen.memory.kv_quant import QuantizedKVCache
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import TensorParallel
from nanoqwen.parallel.step_broadcast import step_from_wire, step_to_wire
from nanoqwen.runner import runner as runner_module
from nanoqwen.runner import startup
from nanoqwen.runner.cuda_graph import DecodeGraphRunner
from nanoqwen.runner.runner import ModelRunner, moved
from nanoqwen.runner.startup import exact_device, start_runners
from nanoqwen.speculative import proposers
from nanoqwen.weights.checkpoint import read_checkpoint

CUDA = torch.device("cuda")  # only ever compared and passed along here, never used
VOCAB = 800
BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """head_dim 64 (flashinfer's sizes), groups of 4 query heads per KV head."""
    return build_model_64(tmp_path_factory.mktemp("qwen2_64"), num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_config(model_dir: str) -> ModelConfig:
    return read_checkpoint(model_dir).model_config


@pytest.fixture(scope="module")
def shape(model_config: ModelConfig) -> AttentionShape:
    return AttentionShape(
        model_config.num_layers, model_config.num_heads, model_config.num_kv_heads,
        model_config.head_dim,
    )


def choose_backend(
    shape: AttentionShape, device: torch.device = CUDA, name: str | None = None
) -> type:
    """The backend a bfloat16 model of `shape` gets (16-token pages)."""
    return attention_backend_class(name, shape, 16, torch.bfloat16, torch.bfloat16, device)


# ----------------------------------------------------------------- plan fences
class RecordingWrapper:
    def __init__(self, log: list) -> None:
        self.log = log

    def plan(self, *args, **kwargs) -> None:
        self.log.append(("plan", self))

    def run(self, q, kv_cache):
        self.log.append(("run", self))
        return q


def test_a_plan_waits_for_the_copy_of_the_previous_one() -> None:
    log: list = []
    wrapper, event = RecordingWrapper(log), FakeEvent(log)
    fenced = FencedWrapper(wrapper, event)
    for layers in (3, 2):  # two steps, planned once and run once per layer
        fenced.plan("page table")
        for _ in range(layers):
            fenced.run("q", "kv")
    calls = [(name, "event" if who is event else "wrapper") for name, who in log]
    step = [("synchronize", "event"), ("plan", "wrapper"), ("record", "event")]
    assert calls == step + [("run", "wrapper")] * 3 + step + [("run", "wrapper")] * 2


def test_an_engine_on_flashinfer_stand_ins_matches_the_reference(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill, mixed and decode steps, decode steps padded to buckets (each bucket with
    its own wrapper planned into the graph buffers), and decode steps past the largest
    bucket: the same tokens as the reference backend, every plan fenced by its own event."""
    log = fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(registry, "flashinfer_backend_for", lambda *args: FlashInferBackend)
    options = dict(device="cpu", dtype="bfloat16", num_pages=300, max_num_seqs=12,
                   decode_buckets=BUCKETS)
    prompts = random_prompts(VOCAB, [3 + 7 * i for i in range(11)], seed=4)
    outputs, engines = [], []
    for backend in ("flashinfer", "reference"):
        engine = LLMEngine(model_dir, attention_backend=backend, **options)
        ids = [engine.add_request(p, greedy(4 + i % 5)) for i, p in enumerate(prompts[:6])]
        engine.step()
        ids += [engine.add_request(p, greedy(4 + i % 5)) for i, p in enumerate(prompts[6:])]
        final = run_to_completion(engine)
        outputs.append([final[i].token_ids for i in ids])
        engines.append(engine)
    assert outputs[0] == outputs[1]

    backend = engines[0].runner.backend
    fenced = [backend.prefill_wrapper, backend.decode_wrapper]
    fenced += backend.graph_decode_wrappers.values()
    assert sorted(backend.graph_decode_wrappers) == BUCKETS
    event_of = {id(f.wrapper): f.planned for f in fenced}
    assert len({id(event) for event in event_of.values()}) == len(fenced), "an event is shared"
    plans = [i for i, (name, _) in enumerate(log) if name == "plan"]
    for i in plans:
        event = event_of[id(log[i][1])]
        assert log[i - 1] == ("synchronize", event) and log[i + 1] == ("record", event)
    planned = [log[i][1] for i in plans]
    assert any(isinstance(wrapper, FakePrefillWrapper) for wrapper in planned)
    decodes = [wrapper for wrapper in planned if isinstance(wrapper, FakeDecodeWrapper)]
    assert len({id(w) for w in decodes if w.use_cuda_graph}) >= 3, "too few buckets were used"
    assert any(not w.use_cuda_graph for w in decodes), "no decode step passed the largest bucket"


# ----------------------------------------------------------------- kernel availability
def test_warm_up_plans_and_runs_a_decode_and_a_prefill(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for num_tokens in (DECODE, PREFILL):  # 1-token pages
        warm_up_kernels(FlashInferBackend, num_tokens, shape, 1, torch.bfloat16, torch.bfloat16,
                        torch.device("cpu"))
    wrappers = [(name, who) for name, who in log if name in ("plan", "run")]
    assert [(name, type(who)) for name, who in wrappers] == [
        ("plan", FakeDecodeWrapper), ("run", FakeDecodeWrapper),
        ("plan", FakePrefillWrapper), ("run", FakePrefillWrapper),
    ]
    prefill = wrappers[2][1].planned
    assert prefill["qo_indptr"].tolist() == [0, 2] and prefill["kv_indices"].tolist() == [1, 2]
    assert prefill["shape"] == (shape.num_heads, shape.num_kv_heads, 64, 1)
    assert wrappers[2][1].backend == "auto"


@pytest.fixture
def status_screen(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What the start-up status line draws, as a terminal would show it."""
    screen = io.StringIO()
    monkeypatch.setattr(attention_flashinfer, "console", Console(file=screen, force_terminal=True))
    return screen


def test_kernels_are_built_at_start_up_under_a_status_line(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, status_screen: io.StringIO,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_flashinfer.install(monkeypatch)
    built = []
    monkeypatch.setattr(attention_flashinfer, "warm_up_kernels", lambda *args: built.append(args))
    with caplog.at_level(logging.INFO, logger="nanoqwen.attention.flashinfer_backend"):
        chosen = flashinfer_backend_for(shape, 16, torch.bfloat16, torch.bfloat16, CUDA)
    assert chosen is FlashInferBackend
    rest = (shape, 16, torch.bfloat16, torch.bfloat16, CUDA)
    assert built == [(FlashInferBackend, DECODE, *rest), (FlashInferBackend, PREFILL, *rest)]
    assert "compiling flashinfer kernels" in status_screen.getvalue()
    assert any("flashinfer kernels (auto prefill) ready in" in r.getMessage()
               for r in caplog.records)


def test_a_failed_build_falls_back_with_one_warning_naming_the_cause(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, status_screen: io.StringIO,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_flashinfer.install(monkeypatch)
    built = []

    def failing_build(*args) -> None:
        built.append(args)
        raise RuntimeError("ninja: build stopped: subcommand failed.\nFAILED: decode.cuda.o\n")

    monkeypatch.setattr(attention_flashinfer, "warm_up_kernels", failing_build)
    with caplog.at_level(logging.WARNING):
        assert choose_backend(shape) is TorchBackend
    [record] = caplog.records
    message = record.getMessage()
    assert "RuntimeError: ninja: build stopped" in message and "torch" in message
    assert "\n" not in message
    # The decode kernels failed: no prefill kernels are tried, FA3's or FA2's.
    assert [args[:2] for args in built] == [(FlashInferBackend, DECODE)]
    # Asked for by name, flashinfer does not fall back: the user hears why it cannot run.
    with pytest.raises(ValueError, match="ninja: build stopped"):
        choose_backend(shape, name="flashinfer")


def warm_up_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, failing_prefills: set[str]
) -> list[tuple[str, int]]:
    """Run the warm-up's steps on flashinfer's stand-ins on the CPU (whatever device it is
    asked for), with the prefill kernels of `failing_prefills` failing to build; return
    the (backend class, new tokens) of each warm-up."""
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    plan = FakePrefillWrapper.plan

    def prefill_plan(wrapper: FakePrefillWrapper, *args, **kwargs) -> None:
        if wrapper.backend in failing_prefills:
            raise RuntimeError(f"ninja: build stopped: {wrapper.backend} prefill failed\n...")
        plan(wrapper, *args, **kwargs)

    monkeypatch.setattr(FakePrefillWrapper, "plan", prefill_plan)
    warmed_up = []

    def on_the_cpu(backend_class, num_tokens, *args) -> None:
        warmed_up.append((backend_class.__name__, num_tokens))
        warm_up_kernels(backend_class, num_tokens, *args[:-1], torch.device("cpu"))

    monkeypatch.setattr(attention_flashinfer, "warm_up_kernels", on_the_cpu)
    return warmed_up


def test_a_failed_fa3_prefill_build_retries_with_fa2(
    shape: AttentionShape, model_dir: str, monkeypatch: pytest.MonkeyPatch,
    status_screen: io.StringIO, caplog: pytest.LogCaptureFixture,
) -> None:
    warmed_up = warm_up_on_the_cpu(monkeypatch, failing_prefills={"auto"})
    with caplog.at_level(logging.WARNING):
        assert choose_backend(shape) is FlashInferFA2Backend
    assert warmed_up == [("FlashInferBackend", DECODE), ("FlashInferBackend", PREFILL),
                         ("FlashInferFA2Backend", PREFILL)]
    [record] = caplog.records
    assert "auto prefill failed" in record.getMessage() and "FA2" in record.getMessage()
    # The engine then plans its prefills on FA2's kernels and serves as the reference does.
    monkeypatch.setattr(registry, "flashinfer_backend_for", lambda *args: FlashInferFA2Backend)
    options = dict(device="cpu", dtype="bfloat16", num_pages=64, enforce_eager=True)
    prompts = random_prompts(VOCAB, [3, 9, 20], seed=5)
    outputs = []
    for backend in ("flashinfer", "reference"):
        engine = LLMEngine(model_dir, attention_backend=backend, **options)
        ids = [engine.add_request(prompt, greedy(4)) for prompt in prompts]
        final = run_to_completion(engine)
        outputs.append([final[i].token_ids for i in ids])
        if backend == "flashinfer":
            assert engine.runner.backend.prefill_wrapper.wrapper.backend == "fa2"
    assert outputs[0] == outputs[1]


def test_when_fa2_fails_too_the_first_failure_is_the_cause(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, status_screen: io.StringIO,
    caplog: pytest.LogCaptureFixture,
) -> None:
    warmed_up = warm_up_on_the_cpu(monkeypatch, failing_prefills={"auto", "fa2"})
    with caplog.at_level(logging.WARNING):
        assert choose_backend(shape) is TorchBackend
    assert warmed_up[-1] == ("FlashInferFA2Backend", PREFILL)
    [record] = caplog.records
    assert "auto prefill failed" in record.getMessage() and "falling back" in record.getMessage()


def test_the_cpu_uses_the_torch_backend_without_building_anything(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(attention_flashinfer, "warm_up_kernels", pytest.fail)
    with caplog.at_level(logging.WARNING):
        chosen = choose_backend(shape, torch.device("cpu"))
    assert chosen is TorchBackend and not caplog.records
    with pytest.raises(ValueError, match="CUDA"):
        choose_backend(shape, torch.device("cpu"), name="flashinfer")


def test_missing_flashinfer_falls_back_with_one_warning(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with caplog.at_level(logging.WARNING):
        assert choose_backend(shape) is TorchBackend
    [record] = caplog.records
    assert "not installed" in record.getMessage() and "\n" not in record.getMessage()


@pytest.mark.parametrize(
    "head_dim, dtype, kv_dtype, message",
    [(32, torch.bfloat16, torch.bfloat16, "head_dim 32"),
     (128, torch.float32, torch.float32, "float32"),
     (96, torch.float16, torch.float16, "head_dim 96"),
     (128, torch.bfloat16, torch.int8, "not torch.int8")],
)
def test_unsupported_shapes_say_why(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, message: str
) -> None:
    assert message in flashinfer_unsupported_reason(head_dim, dtype, kv_dtype)


@pytest.mark.parametrize(
    "kv_dtype, scale, passed",
    [(torch.float8_e4m3fn, 1.0, {}),
     (torch.float8_e4m3fn, 0.5, {"k_scale": 0.5, "v_scale": 0.5}),
     (torch.bfloat16, 0.5, {})],
    ids=["fp8-at-1", "fp8-at-0.5", "bf16"],
)
def test_run_is_given_kv_scales_only_for_fp8_pages_at_a_scale_other_than_1(
    shape: AttentionShape, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype,
    scale: float, passed: dict[str, float],
) -> None:
    """flashinfer reads pages at scale 1 when given none, and up to 0.5 it multiplies the
    output by any `v_scale` it is given, 1.0 included, in a kernel of its own (one more
    launch per layer and step): so a scale of 1 is left out, for decodes and prefills."""
    log = fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(QuantizedKVCache, "tensor_scale", scale)
    for num_tokens in (DECODE, PREFILL):
        warm_up_kernels(FlashInferBackend, num_tokens, shape, 1, torch.bfloat16, kv_dtype,
                        torch.device("cpu"))
    runs = [who for name, who in log if name == "run"]
    assert [type(who) for who in runs] == [FakeDecodeWrapper, FakePrefillWrapper]
    assert all(who.scale_arguments == {"k_scale": None, "v_scale": None, **passed}
               for who in runs)
    read_at = scale if kv_dtype == torch.float8_e4m3fn else 1.0
    assert all(who.scales == (read_at, read_at) for who in runs)


def test_the_declared_flashinfer_range_starts_where_the_tests_can_run() -> None:
    """The host-without-nvcc test turns flashinfer's JIT off with FLASHINFER_DISABLE_JIT,
    which flashinfer reads from 0.4.0 on: the `cuda` extra must not allow anything older."""
    declared = declared_flashinfer_range()
    assert declared.contains(str(FLASHINFER_DISABLE_JIT_SINCE))
    assert not any(declared.contains(old) for old in ("0.2.5", "0.3.1.post1"))


# ----------------------------------------------------------------- the model's device
class recorder_of:
    """A stand-in for `on_device`: its contexts push their device on `current` while they
    are entered (each one reusable, like the contexts it stands in for)."""

    def __init__(self, current: list[torch.device]) -> None:
        self.current = current

    def __call__(self, device: torch.device) -> AbstractContextManager[None]:
        current = self.current

        class Entered:
            def __enter__(self) -> None:
                current.append(device)

            def __exit__(self, *exc_info: object) -> None:
                current.pop()

        return Entered()


def test_start_up_and_every_step_run_on_the_models_device(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    current: list[torch.device] = []
    seen: dict[str, list[list[torch.device]]] = {}

    def spy(name: str, function):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, []).append(list(current))
            return function(*args, **kwargs)
        return wrapped

    recording_device = recorder_of(current)
    monkeypatch.setattr(runner_module, "on_device", recording_device)
    monkeypatch.setattr(startup, "on_device", recording_device)
    monkeypatch.setattr(startup, "attention_backend_class",
                        spy("choose backend", attention_backend_class))
    monkeypatch.setattr(startup, "make_kv_cache", spy("allocate cache", startup.make_kv_cache))
    monkeypatch.setattr(DecodeGraphRunner, "capture_all",
                        spy("capture", DecodeGraphRunner.capture_all))
    monkeypatch.setattr(ModelRunner, "forward", spy("step", ModelRunner.forward))
    monkeypatch.setattr(DecodeGraphRunner, "forward", spy("bucket step", DecodeGraphRunner.forward))
    engine = LLMEngine(model_dir, device="cpu", num_pages=64, decode_buckets=[1, 2, 4])
    for prompt in random_prompts(VOCAB, [5, 11], seed=1):
        engine.add_request(prompt, greedy(3))
    run_to_completion(engine)
    assert set(seen) == {"choose backend", "allocate cache", "capture", "step", "bucket step"}
    for name, stacks in seen.items():
        assert all(stack == [engine.runner.device] for stack in stacks), name


def test_the_draft_models_passes_and_sampling_run_on_its_device(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine asks its proposer for drafts outside the target runner's device context,
    from whichever thread steps it: the draft runner makes its own device current for its
    passes and for sampling the drafts (its events and generators belong to it)."""
    current: list[torch.device] = []
    monkeypatch.setattr(runner_module, "on_device", recorder_of(current))
    engine = LLMEngine(model_dir, device="cpu", num_pages=64, draft_model=model_dir,
                       num_speculative_tokens=2)
    draft_runner = engine.step_hooks[0].proposer.runner
    # The draft's runner told apart from the target's: what it makes current is noted as
    # another device (its tensors stay where they are).
    draft_device = torch.device("cpu", 1)
    monkeypatch.setattr(draft_runner, "device", draft_device)
    seen: dict[str, list[list[torch.device]]] = {}

    def spy(name: str, function):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, []).append(list(current))
            return function(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(proposers, "on_device", recorder_of(current))
    monkeypatch.setattr(proposers, "draw", spy("draw drafts", proposers.draw))
    monkeypatch.setattr(draft_runner, "forward", spy("draft pass", draft_runner.forward))
    monkeypatch.setattr(proposers, "distribution",
                        spy("draft distribution", proposers.distribution))
    monkeypatch.setattr(engine.runner, "forward", spy("target pass", engine.runner.forward))
    for prompt in random_prompts(VOCAB, [5, 11], seed=1):
        engine.add_request(prompt, greedy(6))
    run_to_completion(engine)
    assert set(seen) == {"draw drafts", "draft pass", "draft distribution", "target pass"}
    assert engine.stats()["speculative"]["proposed_tokens"] > 0
    for name, stacks in seen.items():
        expected = engine.runner.device if name == "target pass" else draft_device
        assert all(stack and set(stack) == {expected} for stack in stacks), (name, stacks)


def test_cuda_names_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert exact_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert exact_device(torch.device("cuda:1")) == torch.device("cuda", 1)
    assert exact_device(torch.device("cpu")) == torch.device("cpu")


# ----------------------------------------------------------------- host-to-device copies
def test_a_step_reaches_the_gpu_in_copies_that_do_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split model's ranks receive each step on the host (rank 0 lays it out there, to
    send it): every tensor goes to the GPU from pinned memory, without blocking, so the
    host never waits for the GPU to finish the step before."""
    laid_out = step_of([(0, [5, 6, 7], [1], 1), (9, [8], [2, 3, 4], 1)], 4)
    received = step_from_wire(step_to_wire(laid_out))
    pinned: list[torch.Tensor] = []
    copies: list[tuple[bool, bool]] = []  # (from pinned memory, non-blocking)
    to = torch.Tensor.to

    def pin_memory(tensor: torch.Tensor) -> torch.Tensor:
        pinned.append(tensor.clone())
        return pinned[-1]

    def recording_to(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append((any(tensor is p for p in pinned), kwargs.get("non_blocking", False)))
            return tensor
        return to(tensor, *args, **kwargs)

    for step in (laid_out, received):
        copies.clear()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "pin_memory", pin_memory)
            patch.setattr(torch.Tensor, "to", recording_to)
            on_gpu = moved(step, CUDA)
        assert len(copies) == 8 and set(copies) == {(True, True)}
        # The host copies of the page table stay on the host, for backends that plan there.
        assert on_gpu.metadata.kv_indptr_host.tolist() == [0, 1, 4]


# ----------------------------------------------------------------- a split model
def test_a_split_model_warms_up_the_kernels_of_its_ranks_heads(
    model_dir: str, model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 of a model with 4 query heads and 1 KV head holds 2 query heads and the
    (replicated) KV head. flashinfer builds a decode kernel per query group size, so the
    warm-up must build that rank's (2 per KV head), not the whole model's (4)."""
    fake_flashinfer.install(monkeypatch)
    warmed_up: list[AttentionShape] = []

    def warm_up(shape: AttentionShape, *args) -> type:
        warmed_up.append(shape)
        return FlashInferBackend

    monkeypatch.setattr(registry, "flashinfer_backend_for", warm_up)
    settings = RunnerSettings(
        device=torch.device("cpu"), dtype=torch.bfloat16, page_size=16, max_model_len=256,
        max_num_seqs=4, chunk_size=64, kv_storage_dtype=torch.bfloat16,
        attention_backend="flashinfer", num_pages=8,
    )
    (runner,) = start_runners([read_checkpoint(model_dir)], settings, TensorParallel(1, 2))
    whole = model_config.attention_shape()
    assert (whole.num_heads, whole.num_kv_heads) == (4, 1)
    assert warmed_up == [AttentionShape(whole.num_layers, 2, 1, whole.head_dim)]
    assert runner.model.attention_shape == warmed_up[0]


# ----------------------------------------------------------------- graph capture
class FakeStream:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device


class FakeGraph:
    def pool(self) -> tuple[int, int]:
        return (id(self), 0)


def test_every_capture_records_on_a_stream_of_the_runners_own_device(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's default capture stream is created once per process, on whichever device
    captured first: a runner on a second GPU must name a stream of its own device."""
    engine = LLMEngine(model_dir, device="cpu", num_pages=64, decode_buckets=[1, 2, 4])
    graphs = engine.runner.graphs
    captures: list[tuple[FakeGraph, object, FakeStream | None]] = []

    @contextmanager
    def capturing(graph: FakeGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        captures.append((graph, pool, stream))
        yield

    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr("nanoqwen.runner.cuda_graph.can_capture", lambda *args: True)
    engine.runner.capture_graphs()
    assert len(captures) == 3 and sorted(graphs.graphs) == [1, 2, 4]
    streams = {id(stream) for _, _, stream in captures}
    assert len(streams) == 1, "every bucket captures on the same stream"
    stream = captures[0][2]
    assert isinstance(stream, FakeStream) and stream.device == engine.runner.device
    # Largest bucket first, and the smaller ones share its memory pool.
    assert [graph for graph, _, _ in captures] == [graphs.graphs[b] for b in (4, 2, 1)]
    assert [pool for _, pool, _ in captures] == [None, captures[0][0].pool(), captures[1][0].pool()]


def test_every_graph_capture_in_the_source_names_its_stream() -> None:
    root = Path(nanoqwen.__file__).parent
    calls = [
        (path.name, call)
        for path in root.rglob("*.py")
        for call in re.findall(r"torch\.cuda\.graph\(([^)]*)\)", path.read_text())
    ]
    assert calls, "no capture found"
    assert all("stream=" in call for _, call in calls), calls
