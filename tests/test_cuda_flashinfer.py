"""The flashinfer path on a GPU: its kernels against the torch backend, CUDA-graph decode,
the plan fences, the start-up kernel build and its fallback.

Each test needs a CUDA GPU and flashinfer, and is skipped by name without them. The
models are `cuda_helpers.model_64`'s (head_dim 64, with and without grouped queries).
"""

import gc
import importlib.util
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bf16_oracle import assert_greedy_agrees, hf_greedy_with_logits
from cuda_helpers import (  # noqa: F401 (fixtures)
    DECODE,
    FLASHINFER_DISABLE_JIT_SINCE,
    MIXED,
    PREFILL_WITH_PREFIX,
    declared_flashinfer_range,
    empty_gpu,
    greedy_outputs,
    model_64,
    needs_flashinfer,
    random_step,
)
from oracle import greedy, random_prompts, run_to_completion
from packaging.version import Version

from nanoqwen import LLMEngine
from nanoqwen.attention.flashinfer_backend import (
    FlashInferBackend,
    flashinfer_backend_for,
)
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.weights.checkpoint import read_checkpoint

pytestmark = [pytest.mark.cuda, needs_flashinfer, pytest.mark.usefixtures("empty_gpu")]

CUDA = torch.device("cuda")
VOCAB = 800
BUCKETS = [1, 2, 4, 8, 16, 24]
REPOSITORY = Path(__file__).resolve().parents[1]

@pytest.mark.parametrize(
    "rows", [PREFILL_WITH_PREFIX, DECODE, MIXED], ids=["prefill", "decode", "mixed"]
)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_matches_torch(rows, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(0)
    pool = KVCache(1, num_kv_heads, head_dim, 16, 64, torch.bfloat16, CUDA)
    pool.kv.normal_()
    inputs = random_step(pool, rows, seed=0)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    initial = pool.kv.clone()
    outputs, caches = [], []
    for backend_class in (TorchBackend, FlashInferBackend):
        pool.kv.copy_(initial)
        backend = backend_class(pool, num_heads, num_kv_heads, head_dim)
        backend.plan(inputs.metadata)
        outputs.append(backend.forward(0, q, k, v))
        caches.append(pool.kv.clone())
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(caches[1], caches[0]), "the backends wrote different slots"


def test_flashinfer_refuses_float32() -> None:
    pool = KVCache(1, 2, 128, 16, 4, torch.float32, CUDA)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        FlashInferBackend(pool, 8, 2, 128)


# ----------------------------------------------------------------- start-up
def test_the_kernels_are_built_and_timed_at_start_up(
    model_64: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="nanoqwen.attention.flashinfer_backend"):
        shape = read_checkpoint(model_64).model_config.attention_shape()
        chosen = flashinfer_backend_for(shape, 16, torch.bfloat16, torch.bfloat16, CUDA)
    assert chosen is FlashInferBackend  # the prefill kernels flashinfer picks built and ran
    assert any("flashinfer kernels (auto prefill) ready in" in r.getMessage()
               for r in caplog.records)


def test_a_host_that_cannot_compile_falls_back_to_torch(model_64: str, tmp_path: Path) -> None:
    """flashinfer with its JIT turned off and an empty kernel cache: what a host without
    nvcc meets. The engine must start on the torch backend, saying why in one line."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        pytest.skip("flashinfer-jit-cache's prebuilt kernels are installed: nothing to compile")
    import flashinfer

    if Version(flashinfer.__version__) < FLASHINFER_DISABLE_JIT_SINCE:
        pytest.skip(f"flashinfer {flashinfer.__version__} cannot turn its JIT off (0.4.0 and "
                    f"later can): outside the range the cuda extra declares, "
                    f"{declared_flashinfer_range()}")
    script = (
        "import sys; from nanoqwen import LLMEngine; "
        "engine = LLMEngine(sys.argv[1], device='cuda', num_pages=64); "
        "print(type(engine.runner.backend).__name__)"
    )
    env = {**os.environ, "FLASHINFER_DISABLE_JIT": "1", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script, model_64], env=env, cwd=REPOSITORY,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "TorchBackend"
    warnings = [line for line in result.stderr.splitlines() if "falling back" in line]
    assert len(warnings) == 1 and "flashinfer could not build or run its kernels" in warnings[0]


# ----------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engines(model_64: str):
    """A graph engine (buckets up to 24, so 25..32 run eagerly) and an eager one."""
    options = dict(device="cuda", max_num_seqs=32, num_pages=512)
    graphed = LLMEngine(model_64, decode_buckets=BUCKETS, **options)
    eager = LLMEngine(model_64, enforce_eager=True, **options)
    yield graphed, eager
    del graphed, eager
    gc.collect()
    torch.cuda.empty_cache()


def test_engine_uses_flashinfer_and_captures_every_bucket(engines) -> None:
    graphed, eager = engines
    backend = graphed.runner.backend
    assert isinstance(backend, FlashInferBackend)
    assert sorted(graphed.runner.graphs.graphs) == BUCKETS
    assert eager.runner.graphs is None
    # One event per wrapper: each fences its own staging buffer.
    wrappers = [backend.prefill_wrapper, backend.decode_wrapper]
    wrappers += backend.graph_decode_wrappers.values()
    assert len({id(wrapper.planned) for wrapper in wrappers}) == len(BUCKETS) + 2


@pytest.mark.parametrize("batch_size", [1, 3, 5, 17, 30])
def test_graph_replay_matches_eager(model_64: str, engines, batch_size: int) -> None:
    """Replayed and eager decodes both agree with transformers up to bfloat16 near-ties.
    Not with each other bit for bit: a graph pads its GEMMs' rows to the bucket and plans
    split-KV for the bucket, which round in other places than an eager step does."""
    graphed, eager = engines
    rng = random.Random(batch_size)
    lengths = [rng.randint(2, 60) for _ in range(batch_size)]
    prompts = random_prompts(VOCAB, lengths, seed=batch_size)
    expected = [hf_greedy_with_logits(model_64, prompt, 12, device="cuda") for prompt in prompts]
    for engine in (graphed, eager):
        ids = [engine.add_request(prompt, greedy(12)) for prompt in prompts]
        final = run_to_completion(engine)
        for request_id, (hf_tokens, hf_logits) in zip(ids, expected):
            assert_greedy_agrees(final[request_id].token_ids, hf_tokens, hf_logits)


def test_replays_allocate_nothing(engines) -> None:
    engine = engines[0]
    for prompt in random_prompts(VOCAB, [7, 20, 33, 4, 50], seed=3):
        engine.add_request(prompt, greedy(50))
    engine.step()  # the prefill
    inputs = engine.runner.prepare(engine.scheduler.schedule().rows)
    assert inputs.metadata.batch_size == 8 and inputs.bucket == 8
    logits = engine.runner.forward(inputs)
    first = logits.clone()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(100):
        logits = engine.runner.forward(inputs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(logits, first)  # same step replayed: same logits
    for request_id in list(engine.requests):
        engine.abort(request_id)


def test_capture_reports_what_it_did(model_64: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        LLMEngine(model_64, device="cuda", num_pages=64, decode_buckets=[1, 2])
    assert any("captured 2 decode CUDA graphs" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "chunk_size, buckets", [(16, None), (1, [1, 2])], ids=["prefill-chunks", "graph-replays"]
)
def test_steps_that_sample_nothing_attend_with_their_own_plan(
    model_64: str, chunk_size: int, buckets: list[int] | None
) -> None:
    """Back-to-back steps that sample nothing never wait for the GPU in between: long
    prompts in 16-token chunks, or one token a step replayed from a graph. Each step's
    plan must still be the one it attends with (the fences of `FencedWrapper`)."""
    engine = LLMEngine(model_64, device="cuda", chunk_size=chunk_size, decode_buckets=buckets,
                       num_pages=256)
    prompts = random_prompts(VOCAB, [300, 211], seed=9)
    ids = [engine.add_request(prompt, greedy(12)) for prompt in prompts]
    final = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts):
        hf_tokens, hf_logits = hf_greedy_with_logits(model_64, prompt, 12, device="cuda")
        assert_greedy_agrees(final[request_id].token_ids, hf_tokens, hf_logits)


def test_an_engine_on_cuda_0_serves_from_another_thread(model_64: str) -> None:
    engine = LLMEngine(model_64, device="cuda:0", decode_buckets=[1, 2, 4], num_pages=256)
    assert engine.runner.device == torch.device("cuda", 0)
    assert sorted(engine.runner.graphs.graphs) == [1, 2, 4]
    prompts = random_prompts(VOCAB, [5, 17, 40], seed=10)
    in_thread = greedy_outputs(engine, prompts, 10, in_thread=True)
    assert in_thread == greedy_outputs(engine, prompts, 10)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphs_on_the_second_gpu_match_the_first(model_64: str) -> None:
    """Built while cuda:0 is current and stepped from a thread whose current device is
    cuda:0: capture and replay must still happen on cuda:1."""
    torch.cuda.set_device(0)
    prompts = random_prompts(VOCAB, [5, 17, 40], seed=11)
    outputs = []
    for device in ("cuda:0", "cuda:1"):
        engine = LLMEngine(model_64, device=device, decode_buckets=[1, 2, 4], num_pages=256)
        assert sorted(engine.runner.graphs.graphs) == [1, 2, 4]
        outputs.append(greedy_outputs(engine, prompts, 10, in_thread=True))
    assert outputs[1] == outputs[0]


def test_kv_pool_fills_the_memory_budget(model_64: str) -> None:
    """Default buckets (1..256, one decode wrapper each), 64 sequences decoding in a
    graph and 8 long prompts: the pool takes the budget and nothing overruns it."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free) / total + 0.2)
    engine = LLMEngine(model_64, device="cuda", gpu_memory_utilization=utilization)
    assert len(engine.runner.graphs.graphs) == len(engine.runner.graphs.buckets)
    for prompt in random_prompts(VOCAB, [1000 + i for i in range(8)], seed=5):
        engine.add_request(prompt, greedy(4))
    for prompt in random_prompts(VOCAB, [20 + i for i in range(64)], seed=6):
        engine.add_request(prompt, greedy(30))
    run_to_completion(engine, check=False)
    pool_bytes = engine.runner.kv_cache.kv.numel() * engine.runner.kv_cache.kv.element_size()
    free_after, _ = torch.cuda.mem_get_info()
    assert pool_bytes > 0.1 * total, "the pool took much less than the budget"
    assert total - free_after <= utilization * total + (512 << 20), "the budget was overrun"
