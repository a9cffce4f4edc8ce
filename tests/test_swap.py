"""Preemption by swapping: a preempted request's pages go to host memory and come back, the
outputs are those of a run never preempted, the host pool's pages are all accounted for,
and a pool too small falls back to recompute. Quantized caches swap their scales too;
models with recurrent layers refuse."""

import functools

import pytest
import torch
from cli_options import parse_engine_options
from oracle import greedy, random_prompts, run_to_completion

from nanoqwen import LLM, LLMEngine
from nanoqwen.config import EngineConfig
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.memory.kv_quant import QuantizedKVCache
from nanoqwen.memory.swap import HostKVPool

VOCAB = 800
MiB = 1 << 20
# 8 usable pages of 4 tokens: four requests of 9 to 12 prompt tokens and 12 generated
# outgrow it together, so some are preempted, and their cached pages evicted meanwhile.
TIGHT = dict(device="cpu", page_size=4, num_pages=9, max_num_seqs=4)
LENGTHS = [9, 12, 10, 11]


def run(model: str, **options: object) -> tuple[list[list[int]], dict]:
    """The tight workload's outputs (checking pages and host pages after every step) and
    the engine's stats."""
    engine = LLMEngine(model, **options)
    prompts = random_prompts(VOCAB, LENGTHS, seed=80)
    ids = [engine.add_request(prompt, greedy(12)) for prompt in prompts]
    final = run_to_completion(engine)
    return [final[i].token_ids for i in ids], engine.stats()


@functools.cache
def unhurried(model: str, **options: str) -> list[list[int]]:
    """The tight workload's outputs with room for everyone (never preempted), run once."""
    prompts = random_prompts(VOCAB, LENGTHS, seed=80)
    return [o.token_ids for o in LLM(model, device="cpu", **options).generate(prompts, greedy(12))]


def test_swapped_requests_resume_where_they_were(qwen2_dir: str) -> None:
    outputs, stats = run(qwen2_dir, preemption_mode="swap", swap_space=MiB, **TIGHT)
    assert outputs == unhurried(qwen2_dir)
    swap, requests = stats["swap"], stats["requests"]
    assert requests["preemptions"] > 0
    assert swap["swaps_out"] == requests["preemptions"] and swap["recomputed"] == 0
    assert swap["swaps_in"] > 0 and 0 < swap["pages_in"] <= swap["pages_out"]
    assert swap["host_pages_used"] == 0  # every copy dropped once its request ran again


@pytest.mark.parametrize("host_pages", [0, 2])
def test_a_full_host_pool_falls_back_to_recompute(qwen2_dir: str, host_pages: int) -> None:
    page_bytes = LLMEngine(qwen2_dir, **TIGHT).runner.kv_cache.nbytes // TIGHT["num_pages"]
    swap_space = host_pages * page_bytes + page_bytes // 2  # half a page more is no page
    outputs, stats = run(qwen2_dir, preemption_mode="swap", swap_space=swap_space, **TIGHT)
    assert outputs == unhurried(qwen2_dir)
    swap = stats["swap"]
    assert swap["host_pages_total"] == host_pages and swap["recomputed"] > 0
    assert swap["swaps_out"] + swap["recomputed"] == stats["requests"]["preemptions"]
    if host_pages == 0:
        assert swap["swaps_out"] == swap["pages_out"] == 0


def test_only_the_pages_the_cache_lost_come_back(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", page_size=4, preemption_mode="swap", swap_space=MiB)
    prompt = random_prompts(VOCAB, [20], seed=81)[0]
    request_id = engine.add_request(prompt, greedy(10))
    request = engine.requests[request_id]
    engine.step()
    scheduler = engine.scheduler
    # Still cached when it resumes: nothing is copied back.
    scheduler._preempt(request, "kv_pages", [])
    assert len(scheduler.swapped[request]) == 5
    engine.step()
    assert engine.stats()["swap"]["pages_in"] == 0 and not scheduler.swapped
    engine.step()
    # Evicted meanwhile: the copy comes back, and the request goes on as if never stopped.
    scheduler._preempt(request, "kv_pages", [])
    copied = len(scheduler.swapped[request])
    assert engine.reset_prefix_cache() >= copied
    final = run_to_completion(engine)
    swap = engine.stats()["swap"]
    assert (swap["swaps_in"], swap["pages_in"]) == (1, copied)
    expected = LLM(qwen2_dir, device="cpu", enable_prefix_cache=False).generate([prompt], greedy(10))
    assert final[request_id].token_ids == expected[0].token_ids


def test_an_abort_while_swapped_frees_the_host_pages(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", page_size=4, preemption_mode="swap", swap_space=MiB)
    request_id = engine.add_request(random_prompts(VOCAB, [12], seed=82)[0], greedy(10))
    engine.step()
    engine.scheduler._preempt(engine.requests[request_id], "kv_pages", [])
    assert engine.stats()["swap"]["host_pages_used"] == 3
    engine.abort(request_id)
    assert engine.stats()["swap"]["host_pages_used"] == 0 and not engine.scheduler.swapped


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_caches_swap_their_scales_too(qwen2_dir: str, kv_cache_dtype: str) -> None:
    options = dict(kv_cache_dtype=kv_cache_dtype, attention_backend="torch")
    outputs, stats = run(qwen2_dir, preemption_mode="swap", swap_space=MiB, **TIGHT, **options)
    assert outputs == unhurried(qwen2_dir, **options)
    assert stats["swap"]["pages_in"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_the_host_pool_copies_every_byte_back(dtype: torch.dtype) -> None:
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=6)
    if dtype == torch.bfloat16:
        cache = KVCache(**shape, dtype=dtype, device=torch.device("cpu"))
    else:
        cache = QuantizedKVCache(**shape, dtype=torch.bfloat16, device=torch.device("cpu"),
                                 storage_dtype=dtype)
    for tensor in (cache.kv, cache.scales):
        if tensor is not None:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape))
    before = [t.clone() for t in (cache.kv, cache.scales) if t is not None]
    pool = HostKVPool(cache, swap_space=3 * cache.nbytes // cache.num_pages)
    assert pool.num_pages == 3
    assert pool.swap_out([1, 2, 3, 4]) is None  # more than it holds: nothing taken
    host = pool.swap_out([4, 2])
    assert pool.num_used_pages == 2
    for tensor in (cache.kv, cache.scales):
        if tensor is not None:
            tensor.view(torch.uint8)[:, :, [4, 2]] = 0
    pool.swap_in(host, [5, 1])  # into other pages
    for original, tensor in zip(before, (cache.kv, cache.scales)):
        as_bytes = original.view(torch.uint8)
        assert torch.equal(tensor.view(torch.uint8)[:, :, [5, 1]], as_bytes[:, :, [4, 2]])
    pool.release(host)
    assert pool.num_used_pages == 0


def test_models_with_recurrent_layers_refuse_swap(newer_kind_dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="recurrent layers.*preemption_mode='recompute'"):
        LLMEngine(newer_kind_dirs["qwen3_next"], device="cpu", preemption_mode="swap", swap_space=MiB)


def test_settings_are_validated() -> None:
    base = dict(model="m", device="cpu")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineConfig(**base, preemption_mode="drop")
    with pytest.raises(ValueError, match="needs swap_space"):
        EngineConfig(**base, preemption_mode="swap")
    with pytest.raises(ValueError, match="leave enable_prefix_cache on"):
        EngineConfig(**base, preemption_mode="swap", swap_space=MiB, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(**base, preemption_mode="swap", swap_space=MiB, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="only used with preemption_mode='swap'"):
        EngineConfig(**base, swap_space=MiB)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="swap_space must be a number of bytes"):
            EngineConfig(**base, preemption_mode="swap", swap_space=bad)


def test_command_line_options() -> None:
    code, seen = parse_engine_options(["--preemption-mode", "swap", "--swap-space", "4e9"])
    assert code == 0
    assert (seen["preemption_mode"], seen["swap_space"]) == ("swap", 4_000_000_000)
    assert parse_engine_options(["--preemption-mode", "drop"])[0] == 2
    assert parse_engine_options(["--swap-space", "-1"])[0] == 2
