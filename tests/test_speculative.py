"""Speculative decoding: greedy output unchanged, sampled output distributed as the target's,
rejected drafts rolled back, pages and both models' KV consistent after every step."""

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from cli_options import parse_engine_options
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import check_page_accounting, greedy, random_prompts

from nanoqwen import LLM, LLMEngine, SamplingParams
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.sampling.penalties import Penalties
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Row
from nanoqwen.speculative.proposers import NgramIndex
from nanoqwen.speculative.verification import sample_with_drafts
from tools.checkpoints import TINY_VOCAB_SIZE, build_qwen3, synthetic_tokenizer

VOCAB = 800


# --------------------------------------------------------------------------- helpers
def check_speculation_invariants(engine: LLMEngine) -> None:
    """Page accounting, and between steps: no guesses are left over, and a running
    request holds exactly the pages of its computed (accepted) tokens."""
    check_page_accounting(engine)
    page_size = engine.allocator.page_size
    assert not engine.step_hooks[0].drafted
    for request in engine.requests.values():
        assert request.num_computed_tokens < request.num_tokens
        if request.status is Status.RUNNING:
            assert len(request.pages) == -(-request.num_computed_tokens // page_size)


def tree_sequences(engine: LLMEngine) -> list[list[int]]:
    """The token sequence spelled by the path to every node of the prefix tree."""
    sequences, stack = [], [(engine.cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        tokens = prefix + node.tokens
        sequences.append(tokens)
        stack.extend((child, tokens) for child in node.children.values())
    return sequences


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    priorities: list[int] | None = None,
    arrivals: list[int] | None = None,
) -> list:
    """Serve `prompts`, each added before engine step `arrivals[i]` (default: all at once)
    with `priorities[i]`, checking the invariants after every step."""
    priorities = priorities or [0] * len(prompts)
    arrivals = arrivals or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i], reverse=True)
    ids: dict[int, str] = {}
    final = {}
    for step in itertools.count():
        while pending and arrivals[pending[-1]] <= step:
            i = pending.pop()
            ids[i] = engine.add_request(prompts[i], params[i], priority=priorities[i])
        if not pending and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        check_speculation_invariants(engine)
    outputs = [final[ids[i]] for i in range(len(prompts))]
    if engine.cache is not None:  # the cache holds only prefixes of real, accepted text
        texts = [o.prompt_token_ids + o.token_ids for o in outputs]
        for sequence in tree_sequences(engine):
            assert any(text[: len(sequence)] == sequence for text in texts)
    return outputs


def repetitive_prompt(pattern: list[int], length: int) -> list[int]:
    return (pattern * (length // len(pattern) + 1))[:length]


@pytest.fixture(scope="module")
def references(qwen2_dir: str, qwen3_dir: str) -> dict[str, LLM]:
    """No speculation, no cache, one big chunk: the plain way to compute everything."""
    return {
        d: LLM(d, device="cpu", enable_prefix_cache=False, chunk_size=100_000) for d in (qwen2_dir, qwen3_dir)
    }


# --------------------------------------------------------------------------- greedy output
PENALTIES = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.6, "presence_penalty": 0.4}]


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([1, 4, 16]))
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["random", "repetitive", "shared"]))
        length = draw(st.integers(1, 60))
        seed = draw(st.integers(0, 10_000))
        prompt = random_prompts(VOCAB, [length], seed=seed)[0]
        if kind == "repetitive":
            prompt = repetitive_prompt(prompt[: draw(st.integers(1, 5))], length)
        elif kind == "shared" and prompts:  # a prefix of an earlier prompt, for the cache
            prompt = prompts[-1][: draw(st.integers(1, len(prompts[-1])))] + prompt[:8]
        prompts.append(prompt)
    max_tokens = [draw(st.integers(1, 30)) for _ in prompts]
    needed_alone = max(-(-(len(p) + m) // page_size) for p, m in zip(prompts, max_tokens))
    ngram_min = draw(st.integers(1, 3))
    # Under the priority policy, urgent late arrivals preempt running requests for seats
    # and pages, so drafts are rolled back around preemptions of that kind too.
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    return {
        "prompts": prompts,
        "priorities": [draw(st.integers(-2, 2)) if policy == "priority" else 0 for _ in prompts],
        "arrivals": [draw(st.sampled_from([0, 0, 3, 10])) for _ in prompts],
        "params": [
            SamplingParams(
                temperature=0, max_tokens=m, ignore_eos=True, **draw(st.sampled_from(PENALTIES))
            )
            for m in max_tokens
        ],
        "options": {
            "device": "cpu",
            "page_size": page_size,
            "chunk_size": draw(st.sampled_from([5, 32, 4096])),
            "enable_prefix_cache": draw(st.booleans()),
            # A tight pool preempts; the scratch page and one spare page on top of what the
            # longest request needs alone.
            "num_pages": needed_alone + draw(st.sampled_from([2, 4, 1000])),
            "num_speculative_tokens": draw(st.integers(1, 6)),
            "ngram_min": ngram_min,
            "ngram_max": draw(st.integers(ngram_min, 4)),
            "scheduling_policy": policy,
            "max_num_seqs": draw(st.sampled_from([2, 256])),
            "priority_aging_steps": draw(st.sampled_from([0, 4])),
        },
    }


@pytest.mark.slow
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=workloads())
def test_ngram_greedy_output_is_unchanged(
    model_dir: str, references: dict[str, LLM], workload: dict
) -> None:
    expected = references[model_dir].generate(workload["prompts"], workload["params"])
    engine = LLMEngine(model_dir, speculative="ngram", **workload["options"])
    outputs = run(engine, workload["prompts"], workload["params"], workload["priorities"],
                  workload["arrivals"])
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected]


@pytest.mark.slow
@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=workloads(), self_drafted=st.booleans())
def test_draft_model_greedy_output_is_unchanged_for_any_workload(
    model_dir: str, qwen2_dir: str, qwen3_dir: str, references: dict[str, LLM], workload: dict,
    self_drafted: bool,
) -> None:
    """The same property with a draft model: itself (mostly accepted) or the other fixture
    (mostly rejected, so rolled back)."""
    other = qwen3_dir if model_dir == qwen2_dir else qwen2_dir
    options = {k: v for k, v in workload["options"].items() if not k.startswith("ngram")}
    engine = LLMEngine(model_dir, draft_model=model_dir if self_drafted else other, **options)
    outputs = run(engine, workload["prompts"], workload["params"], workload["priorities"],
                  workload["arrivals"])
    expected = references[model_dir].generate(workload["prompts"], workload["params"])
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


@pytest.mark.slow
def test_ngram_speculation_is_exercised(qwen3_dir: str, references: dict[str, LLM]) -> None:
    """The workload shape of the property test does accept, reject and preempt."""
    prompts = [repetitive_prompt([11, 12, 13], 40), *random_prompts(VOCAB, [30, 50, 7], seed=3)]
    params = [greedy(30)] * len(prompts)
    engine = LLMEngine(qwen3_dir, device="cpu", speculative="ngram", num_pages=24, page_size=4, chunk_size=32)
    outputs = run(engine, prompts, params)
    expected = references[qwen3_dir].generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.stats()
    assert stats["requests"]["preemptions"] > 0
    speculation = stats["speculative"]
    proposed, accepted = speculation["proposed_tokens"], speculation["accepted_tokens"]
    assert 0 < accepted < proposed and speculation["acceptance_rate"] == accepted / proposed
    assert speculation["mean_accepted_length"] == pytest.approx(
        1 + accepted / speculation["verifications"]
    )
    # Fewer steps than tokens: some steps gave a request several.
    assert stats["tokens"]["generated"] == sum(len(o.token_ids) for o in outputs)


def test_ngram_speculation_under_priority_preemption(
    qwen3_dir: str, references: dict[str, LLM]
) -> None:
    """An urgent late arrival takes the only seat from a request that is speculating: the
    preempted request's drafts are dropped with its pages, and both answers are unchanged."""
    prompts = [repetitive_prompt([11, 12, 13], 40), random_prompts(VOCAB, [12], seed=5)[0]]
    params = [greedy(30), greedy(8)]
    engine = LLMEngine(
        qwen3_dir, device="cpu", speculative="ngram", scheduling_policy="priority", max_num_seqs=1,
        page_size=4, num_pages=40,
    )
    outputs = run(engine, prompts, params, priorities=[1, 0], arrivals=[0, 6])
    expected = references[qwen3_dir].generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.stats()
    assert stats["requests"]["preemptions_by_cause"]["max_num_seqs"] >= 1
    assert stats["speculative"]["accepted_tokens"] > 0


# --------------------------------------------------------------------------- draft model
@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_greedy_output_is_unchanged(
    qwen2_dir: str, qwen3_dir: str, references: dict[str, LLM], draft: str
) -> None:
    """Drafted by itself (everything accepted) or by the other fixture (a different
    architecture, same tokenizer: mostly rejected), with chunked prefill, a shared
    prefix for the cache and a pool small enough to preempt."""
    draft_dir = qwen3_dir if draft == "self" else qwen2_dir
    shared = random_prompts(VOCAB, [40], seed=5)[0]
    prompts = [shared + [7, 8], shared + [9], *random_prompts(VOCAB, [3, 70, 25], seed=6)]
    params = [greedy(24)] * len(prompts)
    engine = LLMEngine(
        qwen3_dir, device="cpu", draft_model=draft_dir, num_speculative_tokens=3, num_pages=24, page_size=8,
        chunk_size=16,
    )
    outputs = run(engine, prompts, params)
    expected = references[qwen3_dir].generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.stats()
    assert stats["requests"]["preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["speculative"]["proposed_tokens"] > 0
    if draft == "self":  # the same model guesses right (up to float noise across batch shapes)
        assert stats["speculative"]["acceptance_rate"] > 0.9
    else:
        assert stats["speculative"]["acceptance_rate"] < 0.5


def kv_of(pool: KVCache, request: Request, num_tokens: int) -> torch.Tensor:
    """A pool's K/V of a request's first `num_tokens` tokens, `[layers, 2, tokens, ...]`."""
    size = pool.page_size
    slots = torch.tensor([request.pages[i // size] * size + i % size for i in range(num_tokens)])
    return pool.kv.flatten(2, 3)[:, :, slots]


@pytest.mark.slow
def test_draft_model_kv_follows_the_accepted_tokens(qwen2_dir: str, qwen3_dir: str) -> None:
    """After every step, the draft pool holds exactly the K/V the draft model computes
    for each request's accepted tokens from scratch, rollbacks included."""
    engine = LLMEngine(
        qwen3_dir, device="cpu", draft_model=qwen2_dir, num_speculative_tokens=3, page_size=4, chunk_size=16,
        num_pages=64,
    )
    fresh = LLMEngine(qwen2_dir, device="cpu", enable_prefix_cache=False, page_size=4, num_pages=32)
    prompts = [repetitive_prompt([21, 22], 30), *random_prompts(VOCAB, [45, 9], seed=8)]
    for prompt in prompts:
        engine.add_request(prompt, greedy(20))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        check_speculation_invariants(engine)
        for request in engine.requests.values():
            computed = request.num_computed_tokens
            if request.status is not Status.RUNNING or computed == 0:
                continue
            fresh.add_request(request.token_ids[:computed], greedy(1), request_id="probe")
            batch = fresh.scheduler.schedule().rows
            fresh.runner.forward(fresh.runner.prepare(batch))
            probe = fresh.requests["probe"]
            draft_pool = engine.step_hooks[0].proposer.runner.kv_cache
            torch.testing.assert_close(
                kv_of(draft_pool, request, computed), kv_of(fresh.runner.kv_cache, probe, computed)
            )
            fresh.abort("probe")
            checked += 1
    speculation = engine.stats()["speculative"]
    assert checked > 10 and speculation["accepted_tokens"] < speculation["proposed_tokens"]


def test_draft_pool_mirrors_the_target_pool_and_shares_its_memory(
    qwen2_dir: str, qwen3_dir: str
) -> None:
    memory = 1 << 20
    engine = LLMEngine(qwen3_dir, device="cpu", draft_model=qwen2_dir, kv_cache_memory=memory, page_size=8)
    target, draft = engine.runner, engine.step_hooks[0].proposer.runner
    page_bytes = [cache.kv[:, :, 0].nbytes for cache in (target.kv_cache, draft.kv_cache)]
    # Sized together: both caches have the pages that fit in the memory of the two.
    assert draft.kv_cache.num_pages == target.kv_cache.num_pages == memory // sum(page_bytes) + 1


@pytest.mark.slow
def test_ngram_speculation_across_tensor_parallel_ranks(
    qwen2_dir: str, references: dict[str, LLM]
) -> None:
    """Rank 0 proposes, verifies and rolls back; the other ranks only compute the rows."""
    prompts = [repetitive_prompt([71, 72, 73], 30), *random_prompts(VOCAB, [12, 40], seed=12)]
    options = dict(device="cpu", page_size=4, num_pages=40, chunk_size=16, speculative="ngram")
    with LLM(qwen2_dir, tensor_parallel_size=2, **options) as llm:
        outputs = llm.generate(prompts, greedy(20))
        stats = llm.stats()
    expected = references[qwen2_dir].generate(prompts, greedy(20))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert 0 < stats["speculative"]["accepted_tokens"] < stats["speculative"]["proposed_tokens"]


# --------------------------------------------------------------------------- stop conditions
def test_stops_apply_to_accepted_tokens_only(qwen3_dir: str, references: dict[str, LLM]) -> None:
    prompt = repetitive_prompt([31, 32, 33, 34], 30)
    free_run = references[qwen3_dir].generate([prompt], greedy(30))[0].token_ids
    llm = LLM(qwen3_dir, device="cpu", speculative="ngram", num_speculative_tokens=5)
    cases = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free_run[12]]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        # The prompt's own continuation is proposed (33 after "31 32") but never generated:
        # a stop id among rejected drafts must not stop anything.
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[33, 34], ignore_eos=True),
    ]
    assert 33 not in free_run and 34 not in free_run
    for params in cases:
        expected = references[qwen3_dir].generate([prompt], params)[0]
        deltas = list(llm.stream(prompt, params))
        final = deltas[-1]
        assert final.token_ids == expected.token_ids
        assert final.finish_reason == expected.finish_reason
        assert [t for d in deltas for t in d.delta_token_ids] == final.token_ids
        assert "".join(d.delta_text for d in deltas) == final.text == expected.text
    assert max(len(d.delta_token_ids) for d in deltas) > 1, "no step gave several tokens"
    speculation = llm.stats()["speculative"]
    assert speculation["accepted_tokens"] < speculation["proposed_tokens"]

    # A stop string met inside a run of accepted tokens.
    pieces = [llm.tokenizer.decode([t]) for t in free_run]
    stop = next(piece for piece in pieces[8:] if piece.strip())
    params = SamplingParams(temperature=0, max_tokens=30, stop=stop)
    expected = references[qwen3_dir].generate([prompt], params)[0]
    output = llm.generate([prompt], params)[0]
    assert (output.token_ids, output.text, output.finish_reason) == (
        expected.token_ids, expected.text, expected.finish_reason
    )


def test_max_model_len_caps_the_drafts(qwen3_dir: str, references: dict[str, LLM]) -> None:
    prompt = repetitive_prompt([41, 42], 20)
    llm = LLM(qwen3_dir, device="cpu", speculative="ngram", ngram_min=1, max_model_len=29)
    output = llm.generate([prompt], greedy(100))[0]
    assert len(output.token_ids) == 9 and output.finish_reason == "length"
    assert output.token_ids == references[qwen3_dir].generate([prompt], greedy(9))[0].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, device="cpu", speculative="ngram", ngram_min=1)
    probe = repetitive_prompt([51, 52, 53], 24)
    seeded = SamplingParams(temperature=0.3, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate([probe], seeded)[0].token_ids
    others = random_prompts(VOCAB, [9, 40, 3], seed=9)
    noisy = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    assert llm.generate(others + [probe], [noisy] * 3 + [seeded])[-1].token_ids == alone
    assert llm.stats()["speculative"]["accepted_tokens"] > 0


# --------------------------------------------------------------------------- verification
def verify(logits: torch.Tensor, params: SamplingParams, drafts: list[int], probs=None,
           count: int = 1) -> list[list[int]]:
    """Verify `count` copies of one request with these drafts against these logits rows."""
    rows, draft_probs = [], {}
    for i in range(count):
        request = Request(f"r{i}", [1, 2, 3], params)
        guesses = list(drafts) if isinstance(drafts[0], int) else list(drafts[i])
        draft_probs[request] = probs if probs is None or probs.dim() == 2 else probs[i]
        rows.append(Row(request, 2, [3, *guesses], 1 + len(guesses)))
    sampler = Sampler()
    sampler.add_processor(Penalties)  # as the engine plugs it in for penalised requests
    return sample_with_drafts(sampler, torch.cat([logits] * count), rows, draft_probs.get)


def test_greedy_verification_keeps_the_matching_prefix_and_adds_one() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([4, 7, 2, 9]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0)
    assert verify(logits, params, [4, 7, 2]) == [[4, 7, 2, 9]]  # all right: plus the bonus
    assert verify(logits, params, [4, 8, 2]) == [[4, 7]]  # wrong second draft: corrected
    assert verify(logits, params, [5, 7, 2]) == [[4]]
    assert verify(logits[:2], params, [4]) == [[4, 7]]


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int,
                          frequency: float, output: list[int]) -> torch.Tensor:
    """The textbook distribution, written independently of the sampler."""
    logits = logits.clone()
    for token in output:
        logits[token] -= frequency
    probs = torch.softmax(logits / temperature, dim=-1)
    kept = probs.topk(top_k).indices
    filtered = torch.zeros_like(probs)
    filtered[kept] = probs[kept]
    return filtered / filtered.sum()


def chi_square_p_value(samples: list[int], expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `samples` against `expected`; a sample of a
    zero-probability token fails outright."""
    counts = Counter(samples)
    n = len(samples)
    assert all(expected[token] > 0 for token in counts), "a filtered-out token was emitted"
    support = (expected > 0).nonzero().flatten().tolist()
    means = {t: n * expected[t].item() for t in support}
    stat = sum((counts[t] - mean) ** 2 / mean for t, mean in means.items())
    df = torch.tensor((len(support) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)).item()


# Fixed seed, so the outcome is fixed; a correct sampler passes at this level with 99.9%
# probability per draw of the seed, and the negative controls show the tests have power.
P_VALUE_THRESHOLD = 1e-3
TRIALS = 20_000
TARGET_LOGITS = torch.tensor([1.5, 0.2, -0.5, 1.0, 0.8, -2.0, 0.0, 0.4])


def test_point_mass_drafts_keep_the_target_distribution() -> None:
    """n-gram drafts (q a point mass) with temperature, top-k and a frequency penalty that
    sees the drafts before each row."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=6, frequency_penalty=1.0)
    drafts = [3, 0, 4]
    logits = TARGET_LOGITS.expand(4, -1)
    results = verify(logits, params, drafts, count=TRIALS)
    p = [expected_distribution(TARGET_LOGITS, 0.8, 6, 1.0, drafts[:i]) for i in range(4)]
    assert chi_square_p_value([r[0] for r in results], p[0]) > P_VALUE_THRESHOLD
    # Given the first draft accepted, the second token follows the next row's distribution,
    # whose history now holds the first draft (penalised).
    seconds = [r[1] for r in results if len(r) > 1]
    assert len(seconds) > 1000
    assert chi_square_p_value(seconds, p[1]) > P_VALUE_THRESHOLD
    bonus = [r[3] for r in results if len(r) == 4]
    assert len(bonus) > 200 and chi_square_p_value(bonus, p[3]) > P_VALUE_THRESHOLD
    # Negative control: the first row's distribution without the penalty is rejected.
    unpenalised = expected_distribution(TARGET_LOGITS, 0.8, 6, 0.0, [])
    assert chi_square_p_value(seconds, unpenalised) < 1e-6


def test_draft_model_drafts_keep_the_target_distribution() -> None:
    """Drafts sampled from a different distribution q are accepted with min(1, p/q) and
    replaced from the residual: the first token is distributed as p, not q."""
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    q = torch.softmax(torch.tensor([0.0, 1.0, 1.2, -1.0, 0.5, 0.3, 1.5, -0.5]), dim=-1)
    drafts = torch.multinomial(q.expand(TRIALS, -1), 2, replacement=True, generator=generator)
    results = verify(
        TARGET_LOGITS.expand(3, -1), params, drafts.tolist(), probs=q.expand(TRIALS, 2, -1),
        count=TRIALS,
    )
    firsts = [r[0] for r in results]
    assert chi_square_p_value(firsts, p) > P_VALUE_THRESHOLD
    assert chi_square_p_value(drafts[:, 0].tolist(), p) < 1e-6  # the drafts alone are not p
    # Each draft is accepted with probability sum(min(p, q)); the second is only tried
    # after the first was accepted.
    acceptance = torch.minimum(p, q).sum().item()
    mean_accepted = sum(len(r) - 1 for r in results) / TRIALS
    assert mean_accepted == pytest.approx(acceptance + acceptance**2, abs=0.02)
    seconds = [r[1] for r in results if len(r) > 1]
    assert chi_square_p_value(seconds, p) > P_VALUE_THRESHOLD


def test_sampled_verification_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which rows hold drafts, and which tokens, is known on the host: verification sends
    them to the device and reads back only its outcome, in one copy (on a GPU each read
    waits for every kernel queued before it)."""
    reads: list[torch.Size] = []
    tolist = torch.Tensor.tolist

    def counted(tensor: torch.Tensor) -> list:
        reads.append(tensor.shape)
        return tolist(tensor)

    q = torch.softmax(torch.arange(8.0), dim=-1)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    results = verify(TARGET_LOGITS.expand(3, -1), SamplingParams(temperature=1.0), [[1, 2]] * 3,
                     probs=q.expand(3, 2, -1), count=3)
    monkeypatch.undo()
    assert len(results) == 3 and all(1 <= len(tokens) <= 3 for tokens in results)
    # Tokens for the 9 rows, then whether each of the 6 drafts was accepted.
    assert reads == [torch.Size([9 + 6])]


# --------------------------------------------------------------------------- n-gram lookup
def brute_force_lookup(tokens: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(count):  # the copy may run on into itself
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=4),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    count=st.integers(1, 6),
)
def test_ngram_index_matches_a_brute_force_search(tokens, cuts, min_n, extra, count) -> None:
    """Indexed incrementally as the text grows, the lookup finds what a scan finds."""
    index = NgramIndex(min_n, min_n + extra)
    for cut in sorted(cuts) + [len(tokens)]:
        prefix = tokens[:cut]
        expected = brute_force_lookup(prefix, count, min_n, min_n + extra)
        assert index.propose(prefix, count) == expected


def test_ngram_lookup_prefers_long_and_late_matches() -> None:
    index = NgramIndex(1, 3)
    # "5 6" occurs twice: the later occurrence (followed by 9) wins; "7 5 6" beats both.
    assert index.propose([5, 6, 8, 5, 6, 9, 1, 5, 6], 2) == [9, 1]
    assert NgramIndex(1, 3).propose([7, 5, 6, 8, 5, 6, 9, 7, 5, 6], 2) == [8, 5]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 3) == []
    assert NgramIndex(1, 2).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]  # a run keeps running


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative="medusa"), "speculative"),
        (dict(speculative="draft"), "draft_model"),
        (dict(speculative="ngram", draft_model="x"), "draft_model"),
        (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative="ngram", ngram_min=3, ngram_max=2), "ngram_min"),
    ],
)
def test_bad_speculative_options_raise(qwen3_dir: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, **{"device": "cpu", **options})


def test_draft_model_must_share_the_tokenizer(qwen3_dir: str, tmp_path: Path) -> None:
    other = build_qwen3(tmp_path / "other", seed=1)
    synthetic_tokenizer(TINY_VOCAB_SIZE).save_pretrained(other)  # same size, other tokens
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(qwen3_dir, device="cpu", draft_model=other)


def test_command_line_options_reach_the_engine() -> None:
    args = ["--speculative", "draft", "--draft-model", "d", "--num-speculative-tokens", "3",
            "--ngram-min", "1", "--ngram-max", "5"]
    code, seen = parse_engine_options(args)
    assert code == 0
    assert seen["speculative"] == "draft" and seen["draft_model"] == "d"
    assert (seen["num_speculative_tokens"], seen["ngram_min"], seen["ngram_max"]) == (3, 1, 5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_speculation_matches_plain_decoding(qwen3_dir: str) -> None:
    prompts = [repetitive_prompt([61, 62, 63], 40), *random_prompts(VOCAB, [20, 33], seed=10)]
    plain = LLM(qwen3_dir, device="cuda", dtype="float32").generate(prompts, greedy(32))
    for options in (dict(speculative="ngram"), dict(draft_model=qwen3_dir)):
        llm = LLM(qwen3_dir, device="cuda", dtype="float32", **options)
        outputs = llm.generate(prompts, greedy(32))
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
        assert llm.stats()["speculative"]["accepted_tokens"] > 0
