"""The CUDA path without flashinfer: the torch backend on a GPU, KV sizing, devices.

These need a CUDA GPU and nothing else (each is skipped, by name, without one). The
flashinfer kernels and CUDA graphs are in `test_cuda_flashinfer.py`; what the CUDA path
decides on the host is checked on the CPU in `test_cuda_host.py` and `test_kv_sizing.py`.
"""

import gc
import logging

import pytest
import torch
from cuda_helpers import (  # noqa: F401 (fixtures)
    DECODE,
    MIXED,
    build_model_64,
    empty_gpu,
    greedy_outputs,
    model_64,
    needs_cuda,
    random_step,
)
from oracle import greedy, random_prompts, run_to_completion

from nanoqwen import LLMEngine
from nanoqwen.attention.base import AttentionShape
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.runner.startup import make_kv_cache

GIB = 2**30
VOCAB = 800
CUDA = torch.device("cuda")
# Allocator fragmentation and what the profile's counters cannot see (cuBLAS's first
# handles, the sampler's host copies): room the checks below allow past the budget.
SLACK = 512 << 20

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("empty_gpu")]


def pool_bytes(engine: LLMEngine) -> int:
    return engine.runner.kv_cache.kv.numel() * engine.runner.kv_cache.kv.element_size()


@needs_cuda
@pytest.mark.parametrize("rows", [DECODE, MIXED], ids=["decode", "mixed"])
def test_torch_backend_in_float32_on_cuda_matches_cpu(rows) -> None:
    """float32 on CUDA is served by the torch backend, decodes by its sparse path."""
    torch.manual_seed(0)
    kv = torch.randn(1, 2, 64, 16, 2, 64)
    num_tokens = sum(new for _, new in rows)
    q, k, v = torch.randn(num_tokens, 8, 64), *torch.randn(2, num_tokens, 2, 64)
    outputs = []
    for device in (torch.device("cpu"), CUDA):
        pool = KVCache(1, 2, 64, 16, 64, torch.float32, device)
        pool.kv.copy_(kv)
        backend = TorchBackend(pool, 8, 2, 64)
        backend.plan(random_step(pool, rows, seed=0).metadata)
        outputs.append(backend.forward(0, q.to(device), k.to(device), v.to(device)).cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


@needs_cuda
def test_float32_on_cuda_falls_back_to_torch_without_graphs(
    model_64: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(model_64, device="cuda", dtype="float32", num_pages=64)
    assert isinstance(engine.runner.backend, TorchBackend)
    assert engine.runner.graphs is None
    assert any("float32" in record.getMessage() for record in caplog.records)


@needs_cuda
def test_the_torch_backend_at_long_contexts_stays_within_the_budget(tmp_path) -> None:
    """128 sequences decoding at 4k tokens: the torch backend gathers all their keys into
    a workspace (about 1 GiB here). The pool must be sized around it, not into it."""
    model = build_model_64(tmp_path / "long", 4, max_position_embeddings=4096)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside_allocator = (total - free) - torch.cuda.memory_reserved()
    utilization = (total - free + 4 * GIB) / total  # 4 GiB for this engine
    torch.cuda.reset_peak_memory_stats()
    engine = LLMEngine(model, device="cuda", attention_backend="torch", max_num_seqs=128,
                       max_model_len=4096, gpu_memory_utilization=utilization)
    assert pool_bytes(engine) >= 1 * GIB, "the pool took much less than the budget"
    for prompt in random_prompts(VOCAB, [4000 + i % 80 for i in range(128)], seed=5):
        engine.add_request(prompt, greedy(8))
    run_to_completion(engine, check=False)
    peak = outside_allocator + torch.cuda.max_memory_reserved()
    assert peak <= utilization * total + SLACK, "the budget was overrun"


@needs_cuda
def test_a_kv_cache_fraction_leaves_room_for_the_rest(model_64: str) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    engine = LLMEngine(model_64, device="cuda", attention_backend="torch", kv_cache_memory=0.2,
                       max_num_seqs=64)
    assert 0.15 * free_before <= pool_bytes(engine) <= 0.2 * free_before
    for prompt in random_prompts(VOCAB, [900 + i for i in range(64)], seed=6):
        engine.add_request(prompt, greedy(4))
    run_to_completion(engine, check=False)


@needs_cuda
def test_an_engine_on_cuda_0_steps_from_another_thread(model_64: str) -> None:
    """A server builds the engine in one thread and steps it in another, whose current
    device is its own: the runner makes the model's device current every step."""
    engine = LLMEngine(model_64, device="cuda:0", attention_backend="torch", num_pages=256)
    assert engine.runner.device == torch.device("cuda", 0)
    prompts = random_prompts(VOCAB, [7, 30, 64], seed=7)
    in_thread = greedy_outputs(engine, prompts, 10, in_thread=True)
    assert in_thread == greedy_outputs(engine, prompts, 10)


@needs_cuda
def test_memory_stats_read_the_gpu(qwen3_dir: str) -> None:
    """On CUDA the memory group adds torch's counts for the engine's GPU, which hold at
    least the weights and the KV cache; what it reserved holds what it allocated."""
    engine = LLMEngine(qwen3_dir, device="cuda", attention_backend="torch", num_pages=64)
    memory = engine.stats()["memory"]
    device = engine.runner.device
    assert memory["cuda_allocated_bytes"] == torch.cuda.memory_allocated(device)
    assert memory["cuda_reserved_bytes"] == torch.cuda.memory_reserved(device)
    on_gpu = memory["weight_bytes"] + engine.stats()["kv_cache"]["bytes"]
    assert memory["cuda_reserved_bytes"] >= memory["cuda_allocated_bytes"] >= on_gpu


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_engine_on_the_second_gpu_leaves_the_first_alone(model_64: str) -> None:
    torch.cuda.set_device(0)
    engine = LLMEngine(model_64, device="cuda:1", attention_backend="torch", num_pages=256)
    assert engine.runner.kv_cache.kv.device == torch.device("cuda", 1)
    torch.cuda.synchronize(0)
    on_first = torch.cuda.memory_allocated(0)
    outputs = greedy_outputs(engine, random_prompts(VOCAB, [9, 40], seed=8), 10, in_thread=True)
    assert len(outputs) == 2
    assert torch.cuda.memory_allocated(0) == on_first, "a step allocated on cuda:0"


class SmallCalls(TorchBackend):
    max_call_bytes = 256 << 20


@needs_cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_the_torch_backend_stays_within_its_stated_bound(kv_dtype: torch.dtype) -> None:
    """32 decodes at 4,000 tokens beside a 2,048-token chunk over 2,000 cached tokens, in
    calls of at most 256 MiB: what planning and attending a layer allocate on the GPU stays
    within `step_memory`, the bound the start-up profile checks and the sizing tests use."""
    rows = [(3999, 1)] * 32 + [(2000, 2048)]
    num_pages = 1 + sum(-(-(cached + new) // 16) for cached, new in rows)
    pool = make_kv_cache(1, 8, 128, 16, num_pages, torch.bfloat16, CUDA, storage_dtype=kv_dtype)
    inputs = random_step(pool, rows, seed=0)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, 16, 128, dtype=torch.bfloat16, device=CUDA)
    k, v = torch.randn(2, num_tokens, 8, 128, dtype=torch.bfloat16, device=CUDA)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backend = SmallCalls(pool, 16, 8, 128)
    backend.plan(inputs.metadata)
    out = backend.forward(0, q, k, v)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    bound = SmallCalls.step_memory(
        AttentionShape(1, 16, 8, 128), 16, torch.bfloat16, kv_dtype,
        [new for _, new in rows], [cached + new for cached, new in rows],
    )
    assert len(backend.padded) > 1, "the step was not sliced"
    assert peak <= bound + out.nbytes + (1 << 20), (peak, bound)  # + the output, small tensors
