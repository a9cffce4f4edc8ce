"""Log-probabilities and logit bias in the engine, against transformers' log-softmax.

Generated tokens are scored from the processed distribution (bias, penalties, temperature;
greedy at temperature 1), prompt tokens from the raw model output, chunk by chunk.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoqwen import LLM, SamplingParams
from nanoqwen.outputs import TokenLogprobs
from nanoqwen.sampling.logprobs import with_logprobs
from nanoqwen.sampling.penalties import Penalties
from nanoqwen.sampling.sampler import Sampler

ENGINE = dict(device="cpu", dtype="float32", page_size=8, num_pages=128, max_num_seqs=4)
PROMPT = "the quick brown fox jumps over the lazy dog and then it sleeps while we write"
TOLERANCE = 1e-4


@cache
def reference_logprobs(model_dir: str, token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax at every position of `token_ids`, `[len, vocab]`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(entry: TokenLogprobs, expected: torch.Tensor, token_id: int, k: int) -> None:
    """`entry` scores `token_id` and lists the k best tokens as the `expected` row does."""
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(expected[token_id].item(), abs=TOLERANCE)
    best = expected.topk(k)
    assert [token for token, _ in entry.top] == best.indices.tolist()
    assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    # Prefill chunks of 8 tokens: prompt logprobs come from several steps.
    return LLM(model_dir, chunk_size=8, **ENGINE)


def test_greedy_logprobs_and_prompt_logprobs_match_transformers(llm: LLM, model_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5)
    output = llm.generate(PROMPT, params)[0]
    sequence = output.prompt_token_ids + output.token_ids
    expected = reference_logprobs(model_dir, tuple(sequence))
    num_prompt = len(output.prompt_token_ids)

    assert output.prompt_logprobs[0] is None  # nothing predicts the first token
    assert len(output.prompt_logprobs) == num_prompt > 8  # several prefill chunks
    for position in range(1, num_prompt):
        assert_matches(output.prompt_logprobs[position], expected[position - 1],
                       sequence[position], 5)
    assert len(output.logprobs) == len(output.token_ids)
    for index, entry in enumerate(output.logprobs):
        position = num_prompt + index
        assert_matches(entry, expected[position - 1], sequence[position], 5)
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the likeliest


def test_logprobs_come_from_the_processed_distribution(llm: LLM, model_dir: str) -> None:
    temperature, banned = 0.7, None
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0]
    banned = greedy.token_ids[0]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=1, logprobs=3,
                            logit_bias={banned: -100.0})
    output = llm.generate(PROMPT, params)[0]
    raw = reference_logprobs(model_dir, tuple(output.prompt_token_ids + output.token_ids))[-2]
    # The processed logits: the model's, the bias added, divided by the temperature.
    processed = raw.clone()
    processed[banned] -= 100.0
    processed = torch.log_softmax(processed / temperature, dim=-1)
    [entry] = output.logprobs
    assert output.token_ids[0] != banned
    assert_matches(entry, processed, output.token_ids[0], 3)


def test_logprobs_zero_scores_only_the_chosen_token(llm: LLM) -> None:
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0]
    assert [entry.top for entry in output.logprobs] == [[], [], []]
    assert all(entry.logprob < 0 for entry in output.logprobs)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert plain.token_ids == output.token_ids


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    forced = 123 if greedy[0] != 123 else 124
    biased = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4,
                                                 logit_bias={forced: 100.0}))[0]
    assert biased.token_ids == [forced] * 4
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                 logit_bias={greedy[0]: -100.0}))[0]
    assert banned.token_ids[0] != greedy[0]
    assert SamplingParams(logit_bias={}).logit_bias is None  # empty: no bias
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
    for bad in ({1: 101.0}, {-1: 1.0}, {"1": 1.0}, [1]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_prompt_logprobs_are_computed_once_despite_cache_and_preemption(model_dir: str) -> None:
    llm = LLM(model_dir, chunk_size=8, **ENGINE)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(PROMPT, greedy)  # the prompt's pages are now in the prefix cache
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    request_id = engine.add_request(PROMPT, scored)
    request = engine.requests[request_id]
    engine.step()
    assert request.num_cached_tokens == 0  # nothing owed a logprob comes from the cache
    first_chunk = list(request.prompt_logprobs)
    engine.scheduler._preempt(request, "kv_pages", engine.scheduler.schedule().rows)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.prompt_logprobs[1 : 1 + len(first_chunk)] == first_chunk
    expected = reference_logprobs(model_dir, tuple(final.prompt_token_ids))
    assert len(final.prompt_logprobs) == len(final.prompt_token_ids)
    for position, entry in enumerate(final.prompt_logprobs[1:], start=1):
        assert_matches(entry, expected[position - 1], final.prompt_token_ids[position], 2)
    # A request that owes nothing reuses the cached prefix as before.
    again = llm.generate(PROMPT, greedy)[0]
    assert again.num_cached_tokens > 0


def test_logprobs_cost_one_copy_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring rides along with sampling: one `.tolist()` per step, logprobs or not."""

    class Row:
        def __init__(self, params: SamplingParams) -> None:
            self.params, self.prompt_token_ids, self.output_token_ids = params, [1], []
            self.generator, self.grammar, self.logprobs = None, None, []

    copies = 0
    tolist = torch.Tensor.tolist

    def counted(tensor: torch.Tensor) -> list:
        nonlocal copies
        copies += 1
        return tolist(tensor)

    rows = [Row(SamplingParams(temperature=0, logprobs=4)), Row(SamplingParams(temperature=0.8)),
            Row(SamplingParams(temperature=1.0, logprobs=1, repetition_penalty=1.2))]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()  # as the engine plugs it in for these requests
    sampler.to_host = with_logprobs
    sampler.add_processor(Penalties)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    tokens = sampler.sample(logits, rows)
    assert copies == 1
    assert len(rows[0].logprobs) == 1 and len(rows[0].logprobs[0].top) == 4
    assert rows[0].logprobs[0].token_id == tokens[0] == int(logits[0].argmax())
    assert rows[1].logprobs == [] and len(rows[2].logprobs[0].top) == 1
