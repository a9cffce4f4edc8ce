"""Prefix cache, chunked prefill and preemption: outputs never change, pages always add up."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import (
    assert_unchanged,
    check_page_accounting,
    greedy,
    random_prompts,
    run_to_completion,
)

from nanoqwen import LLM, LLMEngine, SamplingParams

VOCAB = 800


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    """Cache off, one big chunk, a large pool: the plain way to compute everything."""
    return LLM(qwen3_dir, device="cpu", enable_prefix_cache=False, chunk_size=100_000)


@pytest.fixture(scope="module")
def qwen2_reference(qwen2_dir: str) -> LLM:
    return LLM(qwen2_dir, device="cpu", enable_prefix_cache=False, chunk_size=100_000)


@pytest.mark.native_kernels
def test_shared_prefix_is_computed_once(qwen3_dir: str, reference: LLM) -> None:
    prefix = random_prompts(VOCAB, [200], seed=20)[0]
    tails = random_prompts(VOCAB, [3 + i for i in range(16)], seed=21)
    prompts = [prefix + tail for tail in tails]
    engine = LLMEngine(qwen3_dir, device="cpu")
    outputs = generate(engine, prompts, greedy(8))
    full_prefix_pages = len(prefix) // 16 * 16
    assert [o.num_cached_tokens >= full_prefix_pages for o in outputs[1:]] == [True] * 15
    plain = reference.generate(prompts, greedy(8))
    assert_unchanged(qwen3_dir, prompts, outputs, plain, engine.config.dtype)
    cache = engine.stats()["prefix_cache"]
    assert cache["hit_tokens"] >= 15 * full_prefix_pages
    assert cache["hit_rate"] == cache["hit_tokens"] / cache["query_tokens"]


@pytest.mark.native_kernels
def test_second_turn_reuses_first_turn_prompt_and_answer(qwen3_dir: str) -> None:
    engine = LLMEngine(qwen3_dir, device="cpu")
    turn1 = random_prompts(VOCAB, [37], seed=22)[0]
    answer = generate(engine, [turn1], greedy(30))[0].token_ids
    turn2 = turn1 + answer + random_prompts(VOCAB, [9], seed=23)[0]
    second = generate(engine, [turn2], greedy(5))[0]
    # The last answer token was sampled but never fed back, so its K/V does not exist yet.
    computed = len(turn1) + len(answer) - 1
    assert second.num_cached_tokens == computed // 16 * 16
    assert second.num_cached_tokens > len(turn1)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 100_000])
def test_chunking_and_paging_never_change_outputs(
    qwen2_dir: str, chunk_size: int, page_size: int
) -> None:
    prompts = random_prompts(VOCAB, [1, 15, 16, 17, 70], seed=24)
    prompts.append(prompts[3][:16] + [5, 6, 7])  # shares a full page with another prompt
    expected = LLM(qwen2_dir, device="cpu", enable_prefix_cache=False, chunk_size=100_000).generate(prompts, greedy(10))
    engine = LLMEngine(qwen2_dir, device="cpu", chunk_size=chunk_size, page_size=page_size)
    outputs = generate(engine, prompts, greedy(10))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_decodes_advance_every_step_while_a_long_prompt_prefills(qwen3_dir: str) -> None:
    engine = LLMEngine(qwen3_dir, device="cpu", chunk_size=32)
    decoding = [engine.add_request(p, greedy(200)) for p in random_prompts(VOCAB, [5, 9, 13], seed=25)]
    for _ in range(3):
        engine.step()
    long_id = engine.add_request(random_prompts(VOCAB, [600], seed=26)[0], greedy(4))
    prefill_steps = 0
    while engine.requests[long_id].num_computed_tokens < 600:
        moved = {o.request_id for o in engine.step()}
        assert set(decoding) <= moved, "a running decode got no token this step"
        prefill_steps += 1
    assert prefill_steps >= 600 // 32


@pytest.mark.slow
@pytest.mark.native_kernels
def test_small_pool_preempts_and_still_matches(qwen2_dir: str, reference: LLM) -> None:
    prompts = random_prompts(VOCAB, [40, 33, 50, 21, 45, 38, 29, 47], seed=27)
    expected = LLM(qwen2_dir, device="cpu", enable_prefix_cache=False, chunk_size=100_000).generate(prompts, greedy(40))
    for cache in (True, False):
        engine = LLMEngine(qwen2_dir, device="cpu", num_pages=14, enable_prefix_cache=cache, chunk_size=48)
        outputs = generate(engine, prompts, greedy(40))
        assert_unchanged(qwen2_dir, prompts, outputs, expected, engine.config.dtype)
        assert all(o.finish_reason == "length" for o in outputs)
        assert engine.stats()["requests"]["preemptions"] > 0


@pytest.mark.slow
def test_preempted_seeded_request_keeps_its_stream(qwen2_dir: str) -> None:
    prompts = random_prompts(VOCAB, [40, 33, 50, 21], seed=28)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(4)]
    roomy = LLM(qwen2_dir, device="cpu").generate(prompts, params)
    tight = LLMEngine(qwen2_dir, device="cpu", num_pages=9)
    ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = run_to_completion(tight)
    assert tight.stats()["requests"]["preemptions"] > 0
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in roomy]


def test_request_that_can_never_fit(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", num_pages=4)  # 3 usable pages: 48 tokens
    with pytest.raises(ValueError, match="KV cache holds only 48"):
        engine.add_request(list(range(3, 60)), greedy(5))
    request_id = engine.add_request(list(range(3, 40)), greedy(100))
    output = run_to_completion(engine)[request_id]
    assert output.finish_reason == "length"
    assert len(output.prompt_token_ids) + len(output.token_ids) == 48 + 1
    assert engine.stats()["kv_cache"]["pages_used"] == 0


def test_hot_prefix_survives_eviction(qwen3_dir: str) -> None:
    engine = LLMEngine(qwen3_dir, device="cpu", num_pages=16)  # 15 usable pages
    hot = random_prompts(VOCAB, [64], seed=29)[0]  # 4 pages
    colds = random_prompts(VOCAB, [80] * 6, seed=30)  # 5 pages each, never repeated
    hits = []
    for index, cold in enumerate(colds):
        hits.append(generate(engine, [hot + [index + 3]], greedy(2))[0].num_cached_tokens)
        generate(engine, [cold], greedy(2))
        check_page_accounting(engine)
    assert engine.stats()["prefix_cache"]["evicted_pages"] > 0
    assert hits[0] == 0 and hits[1:] == [64] * 5


def test_reset_prefix_cache_frees_everything_unused(qwen3_dir: str) -> None:
    engine = LLMEngine(qwen3_dir, device="cpu")
    generate(engine, random_prompts(VOCAB, [50, 70], seed=31), greedy(4))
    assert engine.stats()["kv_cache"]["pages_cached"] > 0
    running = engine.add_request(random_prompts(VOCAB, [40], seed=32)[0], greedy(20))
    engine.step()
    engine.reset_prefix_cache()
    check_page_accounting(engine)
    stats = engine.stats()
    assert stats["kv_cache"]["pages_cached"] == 0 and stats["kv_cache"]["pages_used"] == 3
    run_to_completion(engine)
    assert engine.reset_prefix_cache() > 0
    assert engine.stats()["kv_cache"]["pages_free"] == engine.stats()["kv_cache"]["pages_total"]
    assert running not in engine.requests


# (policy, KV pages of 4 tokens, one of them scratch, max_num_seqs): fcfs with room for
# six requests; priority with two seats and pages for about two, so that both kinds of
# preemption happen.
TIGHT_ENGINES = [("fcfs", 24, 6), ("priority", 16, 2)]


@pytest.fixture(scope="module", params=TIGHT_ENGINES, ids=lambda p: p[0])
def tight_engine(request: pytest.FixtureRequest, qwen2_dir: str) -> LLMEngine:
    policy, num_pages, max_num_seqs = request.param
    return LLMEngine(
        qwen2_dir, device="cpu", num_pages=num_pages, page_size=4, chunk_size=24, max_num_seqs=max_num_seqs,
        scheduling_policy=policy, priority_aging_steps=16,
    )


ACTIONS = st.lists(
    st.one_of(
        # add: shared prefix (0: none), new tokens, max_tokens, priority
        st.tuples(
            st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 12),
            st.integers(0, 3),
        ),
        st.tuples(st.just("abort"), st.integers(0, 100)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=5,
    max_size=30,
)


@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=ACTIONS, seed=st.integers(0, 1000))
def test_random_workload(
    tight_engine: LLMEngine, qwen2_reference: LLM, actions, seed: int
) -> None:
    """Random arrivals, aborts and (under priority scheduling) priorities in a tiny pool:
    after every step every page is free, cached or in use; every request finishes; every
    output is the plain greedy one (cut short only for a request that can't fit alone)."""
    engine, rng = tight_engine, random.Random(seed)
    capacity = engine.allocator.num_usable_pages * engine.allocator.page_size
    prefixes = random_prompts(VOCAB, [8, 12, 20], seed=seed)
    added: dict[str, tuple[list[int], int]] = {}  # request id → (prompt, max_tokens)
    finished: dict[str, list[int] | None] = {}  # request id → tokens (None: aborted)
    for action in actions:
        if action[0] == "add":
            _, prefix, length, max_tokens, priority = action
            tail = [rng.randrange(3, VOCAB) for _ in range(length)]
            prompt = ((prefixes[prefix - 1] if prefix else []) + tail)[: capacity - 1]
            if engine.config.scheduling_policy == "fcfs":
                priority = 0
            request_id = engine.add_request(prompt, greedy(max_tokens), priority=priority)
            added[request_id] = (prompt, max_tokens)
        elif action[0] == "abort" and added:
            output = engine.abort(list(added)[action[1] % len(added)])
            if output is not None:
                finished[output.request_id] = None
        else:
            for _ in range(action[1]):
                finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
                check_page_accounting(engine)
    finished.update({i: o.token_ids for i, o in run_to_completion(engine).items()})
    assert set(finished) == set(added), "a request was lost"
    done = [(added[i], tokens) for i, tokens in finished.items() if tokens is not None]
    expected = qwen2_reference.generate([prompt for (prompt, _), _ in done], greedy(12))
    for ((prompt, max_tokens), tokens), plain in zip(done, expected):
        assert tokens == plain.token_ids[: len(tokens)]
        if len(prompt) + max_tokens - 1 <= capacity:  # it fits alone, so it finishes
            assert len(tokens) == max_tokens
    stats = engine.stats()
    requests = stats["requests"]
    assert requests["preemptions"] == sum(requests["preemptions_by_cause"].values())
    engine.reset_prefix_cache()
    check_page_accounting(engine)
    assert engine.stats()["kv_cache"]["pages_free"] == engine.allocator.num_usable_pages
