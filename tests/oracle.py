"""What the engine is checked against: transformers on the same weights, and page accounting.

`hf_greedy` / `hf_last_logits` run transformers' own Qwen model, one prompt at a time, as
the ground truth for token ids and logits. `assert_greedy_matches` holds an engine's
greedy tokens to it in the engine's own dtype: identical in float32, identical up to
near-ties in bfloat16 (`bf16_oracle.py` says what a near-tie is). `check_page_accounting`
recomputes, from the requests' page tables and the prefix tree, who holds every page of
the KV pool, and checks that the pool's free list and reference counts agree (and, when
preemption swaps, that the host pool's pages are free or a waiting request's).
"""

import os
from collections import Counter
from functools import lru_cache

import torch
from bf16_oracle import assert_greedy_agrees, hf_greedy_with_logits
from transformers import AutoModelForCausalLM, PreTrainedModel

from nanoqwen import LLMEngine, RequestOutput, SamplingParams
from nanoqwen.memory.page_allocator import SCRATCH_PAGE
from nanoqwen.memory.state_pool import FIRST_SLOT
from nanoqwen.scheduling.request import Status


@lru_cache(maxsize=8)
def hf_model(model_dir: str) -> PreTrainedModel:
    """transformers' model of a checkpoint directory, or of a GGUF file (dequantized)."""
    directory, gguf_file = os.path.split(model_dir) if model_dir.endswith(".gguf") else (model_dir, None)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, never stopping early."""
    ids = torch.tensor([prompt])
    out = hf_model(model_dir).generate(
        ids,
        attention_mask=torch.ones_like(ids),  # prompts may contain the pad id; nothing is padding
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def assert_greedy_matches(
    model_dir: str, prompt: list[int], tokens: list[int], dtype: torch.dtype
) -> None:
    """An engine's greedy `tokens` for `prompt`, computed in `dtype`, against transformers:
    in float32 its greedy tokens exactly; in bfloat16, where how a step is split and summed
    changes the rounding, transformers' bfloat16 tokens up to the first near-tie of its own
    logits, where either choice is right and the two continuations part."""
    if dtype == torch.float32:
        assert tokens == hf_greedy(model_dir, prompt, len(tokens)), f"prompt of {len(prompt)}"
        return
    assert dtype == torch.bfloat16, f"no oracle for {dtype}"
    assert_greedy_agrees(tokens, *hf_greedy_with_logits(model_dir, prompt, len(tokens)))


def assert_unchanged(
    model_dir: str, prompts: list[list[int]], outputs: list[RequestOutput],
    plain: list[RequestOutput], dtype: torch.dtype,
) -> None:
    """Greedy `outputs` of `prompts`, computed another way (chunked, cached, preempted)
    than `plain`: the same tokens in float32; in bfloat16 each agrees with transformers up
    to near-ties (`assert_greedy_matches`), since another split rounds sums differently."""
    if dtype == torch.float32:
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
        return
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_greedy_matches(model_dir, prompt, output.token_ids, dtype)


@torch.no_grad()
def hf_last_logits(model_dir: str, prompt: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1]


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_to_completion(engine: LLMEngine, check: bool = True) -> dict[str, RequestOutput]:
    """Step until every request finishes, checking the page accounting after each step."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        if check:
            check_page_accounting(engine)
    return final


def check_page_accounting(engine: LLMEngine) -> None:
    """Every page is exactly one of free, cached (tree only) or in use (held by requests)."""
    pool, cache = engine.allocator, engine.cache
    request_holds = Counter(
        page for request in engine.requests.values() for page in request.pages
    )
    tree_pages = cache.pages() if cache is not None else []
    tree_holds = Counter(tree_pages)
    assert all(count == 1 for count in tree_holds.values()), "a page appears twice in the tree"
    assert SCRATCH_PAGE not in request_holds and SCRATCH_PAGE not in tree_holds
    free = set(pool.free_pages)
    assert len(free) == len(pool.free_pages), "a page is twice in the free list"
    assert SCRATCH_PAGE not in free
    # Held pages one by one; the rest (most of a large pool) by sums over the lists, which
    # with non-negative counts says each of them has no reference and is free.
    held = request_holds.keys() | tree_holds.keys()
    for page in held:
        holders = request_holds[page] + tree_holds[page]
        assert pool.ref_counts[page] == holders, f"page {page}: refcount != holders"
        assert pool.in_cache[page] == (tree_holds[page] == 1), f"page {page}: in_cache is wrong"
        assert page not in free, f"page {page} is held and free"
    assert sum(pool.ref_counts) == request_holds.total() + tree_holds.total(), "a free page has references"
    assert sum(pool.in_cache) == len(tree_holds), "a page outside the tree is marked cached"
    assert min(pool.ref_counts) >= 0
    free_count = len(free)
    cached_count = sum(1 for page in tree_holds if request_holds[page] == 0)
    used_count = len(request_holds)
    assert free_count + cached_count + used_count == pool.num_usable_pages
    kv = engine.stats()["kv_cache"]
    assert (kv["pages_free"], kv["pages_cached"], kv["pages_used"]) == (
        free_count, cached_count, used_count
    )
    if cache is not None:
        assert cache.num_pages == len(tree_pages)
    if engine.states is not None:
        check_state_accounting(engine)
    if hasattr(engine.scheduler, "swapped"):
        check_host_accounting(engine)


def check_host_accounting(engine: LLMEngine) -> None:
    """Every page of the swap pool is free or held by exactly one swapped-out request, and
    only waiting requests hold any."""
    scheduler = engine.scheduler
    held = [page for pages in scheduler.swapped.values() for page in pages]
    assert sorted(scheduler.host.free + held) == list(range(scheduler.host.num_pages))
    assert all(request.status is Status.WAITING and engine.requests.get(request.request_id)
               is request for request in scheduler.swapped)
    swap = engine.stats()["swap"]
    assert swap["host_pages_used"] == len(held) <= swap["host_pages_total"]


def check_state_accounting(engine: LLMEngine) -> None:
    """Every slot of the state pool is exactly one of free, a running request's, or a
    snapshot's; no two requests share one."""
    states = engine.states
    held = [r.state_slot for r in engine.requests.values() if r.state_slot is not None]
    snapshots = [snapshot.slot for snapshot in states.snapshots.values()]
    everything = sorted(states.free + held + snapshots)
    assert everything == list(range(FIRST_SLOT, FIRST_SLOT + states.num_slots)), everything
    assert len(held) == states.num_running
    pool = engine.stats()["state_pool"]
    assert pool["slots_free"] + pool["slots_running"] + pool["slots_snapshots"] == pool["slots_total"]
