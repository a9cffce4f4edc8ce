"""Sizing the KV cache on a GPU (`runner/startup.py`, `runner/memory_profile.py`), checked on
the CPU where it can be.

The CUDA allocator's counters exist only on a GPU (`test_cuda.py` checks the sizes that
come out there). What does not need them is checked here: the budget the pool gets from
the measured overhead, that the profiled step bounds every step the scheduler forms, and
that the profile runs that step, and the largest graph bucket's, through the backend
that will serve.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import check_page_accounting, greedy, random_prompts
from profiled_ranks import NoCounters
from transformers import AutoConfig, AutoModelForCausalLM

from nanoqwen import LLMEngine
from nanoqwen.attention.base import AttentionShape
from nanoqwen.attention.flashinfer_backend import FlashInferBackend
from nanoqwen.attention.torch_backend import TorchBackend, attention_costs
from nanoqwen.attention.torch_layout import MAX_CALL_BYTES, lay_out
from nanoqwen.config import EngineConfig, RunnerSettings
from nanoqwen.runner.cuda_graph import default_buckets
from nanoqwen.runner.memory_profile import (
    Overhead,
    WorstStep,
    measure_overheads,
    profile_overhead,
    worst_step,
    worst_step_attention_bytes,
)
from nanoqwen.runner.memory_profile import gpu_kv_memory as kv_budget
from nanoqwen.runner.runner import ModelRunner
from nanoqwen.runner.startup import CPU_KV_CACHE_FRACTION, RunnerParts, cpu_kv_memory
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.scheduler import Row
from tools.checkpoints import PRESETS

GIB = 2**30
VOCAB = 800
LIMITS = dict(device="cpu", max_num_seqs=4, chunk_size=16, max_model_len=64, page_size=4)


# ----------------------------------------------------------------- the budget
OVERHEAD = Overhead(resident=1 * GIB, step=2 * GIB, graphs=1 * GIB)


def test_by_default_the_pool_gets_the_utilization_less_use_and_overhead() -> None:
    # 80 GiB, 20 in use (weights, context): 0.9 * 80 - 20 - 4 = 48 GiB for the pool.
    assert kv_budget(60 * GIB, 80 * GIB, OVERHEAD, None, 0.9) == pytest.approx(48 * GIB)


def test_a_fraction_is_of_what_is_free_once_the_overhead_is_set_aside() -> None:
    # 60 GiB free, 4 of them for the rest of the engine: half of 56.
    assert kv_budget(60 * GIB, 80 * GIB, OVERHEAD, 0.5, 0.9) == pytest.approx(28 * GIB)


@given(  # always something left: more free than the largest overhead drawn (6 GiB)
    free=st.integers(6 * GIB + 1, 80 * GIB),
    resident=st.integers(0, GIB), step=st.integers(0, 4 * GIB), graphs=st.integers(0, GIB),
    fraction=st.floats(0.01, 1.0),
)
def test_a_fraction_never_takes_memory_the_rest_of_the_engine_needs(
    free: int, resident: int, step: int, graphs: int, fraction: float
) -> None:
    overhead = Overhead(resident, step, graphs)
    budget = kv_budget(free, 80 * GIB, overhead, fraction, 0.9)
    assert 0 < budget and budget + overhead.total <= free


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_no_memory_left_says_what_to_change(fraction: float | None) -> None:
    with pytest.raises(ValueError, match="lower max_num_seqs, max_model_len or chunk_size"):
        kv_budget(3 * GIB, 80 * GIB, OVERHEAD, fraction, 0.9)


# ----------------------------------------------------------------- the profiled step
def step_shape(rows: list[Row]) -> dict[str, int]:
    """What a step's memory grows with: rows, tokens, sampled rows, context length."""
    lengths = [len(row.token_ids) for row in rows]
    return {
        "rows": len(rows),
        "decodes": sum(n == 1 for n in lengths),
        "tokens": sum(lengths),
        "prompt tokens": sum(n for n in lengths if n > 1),
        "sampled": sum(row.num_sampled for row in rows),
        "context": max((row.start + n for row, n in zip(rows, lengths)), default=0),
    }


@pytest.fixture(scope="module")
def small_engine(qwen3_dir: str) -> LLMEngine:
    """Tight limits and a small pool, so steps hit every limit and requests get preempted."""
    return LLMEngine(qwen3_dir, num_pages=40, **LIMITS)


WORKLOADS = st.lists(
    st.tuples(st.integers(1, 50), st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=10
)


@pytest.mark.slow
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=WORKLOADS, seed=st.integers(0, 1000))
def test_the_profiled_step_bounds_every_scheduled_step(
    small_engine: LLMEngine, workload, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests (prompt length, max tokens, steps before the next arrives)."""
    engine = small_engine
    shapes = []
    prepare = engine.runner.prepare

    def recorded(rows: list[Row], bucket: int | None = None):
        shapes.append(step_shape(rows))
        return prepare(rows, bucket)

    monkeypatch.setattr(engine.runner, "prepare", recorded)
    prompts = random_prompts(VOCAB, [length for length, _, _ in workload], seed=seed)
    for prompt, (_, max_tokens, steps_before) in zip(prompts, workload):
        for _ in range(steps_before):
            engine.step()
        engine.add_request(prompt, greedy(max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    check_page_accounting(engine)
    monkeypatch.undo()

    pages = list(range(1, 1 + LIMITS["max_model_len"] // LIMITS["page_size"]))
    worst = step_shape(
        worst_step(pages, LIMITS["max_num_seqs"], LIMITS["chunk_size"], LIMITS["max_model_len"])
    )
    assert shapes
    for shape in shapes:
        assert all(shape[key] <= worst[key] for key in worst), (shape, worst)


# ----------------------------------------------------------------- the profile itself
class SpyBackend(TorchBackend):
    """The torch backend, noting the page table of every step it plans."""

    planned: list = []

    def plan(self, metadata) -> None:
        SpyBackend.planned.append(metadata)
        super().plan(metadata)


LIMITS_OF_WORST = (LIMITS["max_num_seqs"], LIMITS["chunk_size"], LIMITS["max_model_len"])
WORST = WorstStep(*LIMITS_OF_WORST)


def throwaway_runners(
    engine: LLMEngine, backend_class: type, buckets: list[int]
) -> Callable[[ModelRunner, int], ModelRunner]:
    """What start-up profiles on: a runner of `model` on a cache of `num_pages` pages, with
    `backend_class` and these graph buckets (the engine's own settings otherwise)."""
    parts = RunnerParts(settings_of(engine), backend_class, buckets, engine.device)
    return parts.runner


def settings_of(engine: LLMEngine) -> RunnerSettings:
    return engine.config.runner_settings(engine.max_model_len)


def profile(
    engine: LLMEngine, backend_class: type, buckets: list[int], worst: WorstStep = WORST,
    model=None,
) -> Overhead:
    """Run the memory profile on the CPU, with `backend_class` and these graph buckets."""
    make = throwaway_runners(engine, backend_class, buckets)
    model = model or engine.runner.model
    return profile_overhead(
        lambda num_pages: make(model, num_pages), worst, LIMITS["page_size"], NoCounters(),
        backend_class.__name__,
    )


def test_the_profile_runs_the_worst_steps_through_the_serving_backend(
    small_engine: LLMEngine,
) -> None:
    SpyBackend.planned = []
    profile(small_engine, SpyBackend, [1, 2, 4])
    eager, bucket = SpyBackend.planned
    # Every sequence decoding and a full prefill chunk, all at max_model_len.
    assert eager.batch_size == LIMITS["max_num_seqs"] + 1
    assert sorted(eager.q_lens().tolist()) == [1] * LIMITS["max_num_seqs"] + [LIMITS["chunk_size"]]
    assert eager.max_kv_len == LIMITS["max_model_len"]
    # The largest bucket's decodes, through the bucket runner.
    assert bucket.max_q_len == 1 and bucket.batch_size == 4
    assert bucket.max_kv_len == LIMITS["max_model_len"]


def test_with_speculation_the_profiled_step_verifies_drafts_for_every_sequence(
    qwen3_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(
        qwen3_dir, device="cpu", speculative="ngram", num_speculative_tokens=3, num_pages=64,
        max_num_seqs=LIMITS["max_num_seqs"], chunk_size=LIMITS["chunk_size"],
    )
    rows: list[int] = []
    sample = Sampler.sample

    def spy(sampler, logits, requests):
        rows.append(len(logits))
        return sample(sampler, logits, requests)

    monkeypatch.setattr(Sampler, "sample", spy)
    SpyBackend.planned = []
    profile(engine, SpyBackend, [], WorstStep(*LIMITS_OF_WORST, max_proposed=3))
    (step,) = SpyBackend.planned
    # Every sequence verifying 3 drafts (1 + 3 rows, all sampled), and a prefill chunk.
    decodes = [1 + 3] * LIMITS["max_num_seqs"]
    assert sorted(step.q_lens().tolist()) == sorted(decodes + [LIMITS["chunk_size"]])
    assert step.max_kv_len == LIMITS["max_model_len"]
    assert rows == [1 + sum(decodes)]


class OutOfMemoryBackend(TorchBackend):
    def plan(self, metadata) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")


def test_a_step_that_cannot_fit_says_what_to_change(small_engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="OutOfMemoryBackend.*lower max_num_seqs"):
        profile(small_engine, OutOfMemoryBackend, [])


# ----------------------------------------------------------------- at a GPU's scale
DEVICE_BYTES = 80 * 10**9  # an 80 GB H100
QWEN3_06B = AttentionShape(
    PRESETS["qwen3-0.6b"]["num_hidden_layers"], PRESETS["qwen3-0.6b"]["num_attention_heads"],
    PRESETS["qwen3-0.6b"]["num_key_value_heads"], PRESETS["qwen3-0.6b"]["head_dim"],
)


@pytest.fixture(scope="module")
def cuda_defaults() -> EngineConfig:
    """The engine's default settings on a GPU (read here, where there is none)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        return EngineConfig(model="unused", device="cuda")


@pytest.fixture(scope="module")
def qwen3_06b_weight_bytes() -> int:
    preset = {key: value for key, value in PRESETS["qwen3-0.6b"].items() if key != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **preset))
    return sum(parameter.numel() for parameter in model.parameters()) * torch.bfloat16.itemsize


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "with-a-draft-model"])
@pytest.mark.parametrize(
    "backend_class, kv_dtype",
    [(FlashInferBackend, torch.bfloat16), (TorchBackend, torch.bfloat16),
     (TorchBackend, torch.int8)],
    ids=["flashinfer", "torch-fallback", "torch-int8-kv"],
)
def test_sizing_the_worst_step_of_qwen3_0_6b_on_an_80gb_gpu(
    backend_class: type, kv_dtype: torch.dtype, with_draft: bool, cuda_defaults: EngineConfig,
    qwen3_06b_weight_bytes: int,
) -> None:
    """At default settings (256 sequences at 40,960 tokens beside an 8,192-token chunk,
    4 proposed tokens each with a draft model, here of the same shape), what attention
    needs for the worst step fits in a tenth of the GPU and the KV cache gets most of it."""
    config = cuda_defaults
    max_model_len = PRESETS["qwen3-0.6b"]["max_position_embeddings"]
    num_runners = 2 if with_draft else 1
    worst = WorstStep(config.max_num_seqs, config.chunk_size, max_model_len,
                      config.num_speculative_tokens if with_draft else 0)
    buckets = default_buckets(config.max_num_seqs) if backend_class.supports_cuda_graphs else []
    # A draft model's worst step has no tokens appended to verify.
    steps = [worst, dataclasses.replace(worst, max_proposed=0)][:num_runners]
    attention = sum(
        worst_step_attention_bytes(backend_class, QWEN3_06B, config.page_size, config.dtype,
                                   kv_dtype, step, len(buckets))
        for step in steps
    )
    assert attention <= 0.10 * DEVICE_BYTES
    in_use = num_runners * qwen3_06b_weight_bytes
    kv_cache = kv_budget(DEVICE_BYTES - in_use, DEVICE_BYTES, Overhead(step=attention), None,
                         config.gpu_memory_utilization)
    assert kv_cache >= 0.75 * DEVICE_BYTES


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("max_proposed", [0, 4], ids=["decodes", "verifications"])
def test_sizing_the_torch_fallback_attends_the_worst_step_in_bounded_calls(
    kv_dtype: torch.dtype, max_proposed: int, cuda_defaults: EngineConfig
) -> None:
    """The layout the torch backend's plan follows for the worst step: every token in
    exactly one call, no call past the cap (one decode's whole context is the least a call
    can take), and no decode or verification row padded to the prefill chunk's length."""
    config = cuda_defaults
    max_model_len = PRESETS["qwen3-0.6b"]["max_position_embeddings"]
    costs = attention_costs(QWEN3_06B, config.page_size, config.dtype, kv_dtype)
    q_lens = [config.chunk_size] + [1 + max_proposed] * config.max_num_seqs
    kv_lens = [max_model_len] * len(q_lens)
    layout = lay_out(costs, q_lens, kv_lens)
    assert not layout.fresh and not layout.sparse  # too large for one sparse product
    covered = {}
    for piece in layout.padded:
        assert costs.slice_bytes(len(piece.requests), piece.num_queries, piece.num_pages) \
            <= MAX_CALL_BYTES
        for request in piece.requests:
            queries = range(piece.first_query, piece.first_query + piece.num_queries)
            for query in queries:
                if query < q_lens[request]:
                    assert (request, query) not in covered
                    covered[(request, query)] = piece
        if 0 not in piece.requests:
            assert piece.num_queries == 1 + max_proposed
    assert len(covered) == sum(q_lens)
    # The chunk is cut into ranges of its queries, each over the keys it can see.
    chunk = [piece for piece in layout.padded if piece.requests == (0,)]
    assert len(chunk) > 1 and chunk[-1].num_pages == max_model_len // config.page_size
    assert chunk[0].num_pages < chunk[-1].num_pages


def test_sizing_the_profile_refuses_a_step_whose_attention_cannot_fit(
    small_engine: LLMEngine,
) -> None:
    """Told what the worst step's attention needs, the profile refuses before running it
    when the GPU has less free: a clear error instead of an out-of-memory one midway."""

    class LittleFree(NoCounters):
        def free(self) -> int:
            return 1000

    SpyBackend.planned = []
    make = throwaway_runners(small_engine, SpyBackend, [])
    model = small_engine.runner.model
    message = r"SpyBackend.*lower max_num_seqs.* \(its attention alone needs up to 3\.00 GiB\)"
    arguments = (lambda num_pages: make(model, num_pages), WORST, LIMITS["page_size"])
    with pytest.raises(ValueError, match=message):
        profile_overhead(*arguments, LittleFree(), "SpyBackend", attention_bytes=3 * GIB)
    assert SpyBackend.planned == []  # refused before running anything
    profile_overhead(*arguments, NoCounters(), "SpyBackend", attention_bytes=3 * GIB)
    assert len(SpyBackend.planned) == 1  # with room, the worst step ran


def test_sizing_a_draft_model_is_profiled_on_the_rows_it_runs(qwen3_dir: str) -> None:
    """The draft model computes the target's rows before any drafts are attached, then
    one-token rows: its worst step is the chunk and the sequences' decodes, which is what
    its profile runs; the target's has every decode verifying its drafts."""
    engine = LLMEngine(qwen3_dir, draft_model=qwen3_dir, num_speculative_tokens=3,
                       num_pages=64, **LIMITS)
    target, draft = engine.runner.model, engine.step_hooks[0].proposer.runner.model
    SpyBackend.planned = []
    overhead = measure_overheads([target, draft], throwaway_runners(engine, SpyBackend, []),
                                 SpyBackend, 0, settings_of(engine), NoCounters(), max_proposed=3)
    sequences, chunk = LIMITS["max_num_seqs"], LIMITS["chunk_size"]
    profiled = [sorted(metadata.q_lens().tolist()) for metadata in SpyBackend.planned]
    assert profiled == [sorted([1 + 3] * sequences + [chunk]), sorted([1] * sequences + [chunk])]
    # The distributions the drafts came from, kept until verified: a float32 row over the
    # target's vocabulary per draft of every sequence, set aside beside the cache.
    draft_probs = sequences * 3 * VOCAB * 4
    assert overhead.draft_probs == draft_probs
    assert overhead.total == draft_probs + overhead.resident + overhead.step + overhead.graphs
    assert "draft distributions" in str(overhead)
    alone = measure_overheads([target], throwaway_runners(engine, SpyBackend, []), SpyBackend, 0,
                              settings_of(engine), NoCounters(), max_proposed=3)
    assert alone.draft_probs == 0  # n-gram guesses keep no distributions


# ----------------------------------------------------------------- defaults on a CPU
def test_the_cpu_default_is_what_the_context_needs_within_a_share_of_the_ram() -> None:
    """Every sequence at full length, capped by a share of the machine's RAM: the same
    figure whatever happens to be free at start-up."""
    settings = RunnerSettings(
        device=torch.device("cpu"), dtype=torch.float32, page_size=16, max_model_len=100,
        max_num_seqs=4, chunk_size=16, kv_storage_dtype=torch.float32,
    )
    page_bytes = 1000  # 100 tokens = 7 pages of 16
    needed = 4 * 7 * page_bytes
    assert cpu_kv_memory(10 * GIB, 1 * GIB, None, settings, page_bytes) == needed
    assert cpu_kv_memory(10 * GIB, 5 * GIB, None, settings, page_bytes) == needed
    tiny_ram = needed * 2
    assert cpu_kv_memory(tiny_ram, 1, None, settings, page_bytes) == CPU_KV_CACHE_FRACTION * tiny_ram
    # Asked for as a fraction: of what is free.
    assert cpu_kv_memory(10 * GIB, 4 * GIB, 0.5, settings, page_bytes) == 2 * GIB


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_default_dtype_is_bfloat16_where_the_cpu_has_bf16_arithmetic(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    expected = torch.bfloat16 if native else torch.float32
    assert EngineConfig(model="m", device="cpu").dtype == expected
    assert EngineConfig(model="m", device="cpu", dtype="float32").dtype == torch.float32
    # torch's AVX2 kernels (what the tests run) never take bfloat16 as native.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert EngineConfig(model="m", device="cpu").dtype == torch.float32
