"""Sampler tests on synthetic logits: filters, penalties, seeds and parameter validation."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from nanoqwen.sampling.params import SamplingParams, check_defaults
from nanoqwen.sampling.penalties import AllowedTokens, LogitBias, Penalties
from nanoqwen.sampling.sampler import Sampler, make_generator
from nanoqwen.sampling.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)


def full_sampler() -> Sampler:
    """A sampler with every logits processor of `penalties.py` plugged in, as an engine's is
    once its requests have asked for them all."""
    sampler = Sampler()
    for processor in (Penalties, LogitBias, AllowedTokens):
        sampler.add_processor(processor)
    return sampler


VOCAB = 50


@dataclass
class FakeRequest:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = make_generator(self.params.seed, "cpu")


def requests_for(params: SamplingParams, count: int) -> list[FakeRequest]:
    return [FakeRequest(params) for _ in range(count)]


def random_logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def logits_from_probs(probs: list[float], positions: list[int]) -> torch.Tensor:
    """One logits row over VOCAB whose softmax puts probs[i] on token positions[i], 0 elsewhere."""
    row = torch.full((VOCAB,), -math.inf)
    row[positions] = torch.tensor(probs).log()
    return row


def draw_many(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> Counter[int]:
    torch.manual_seed(1234)  # the shared (unseeded) noise comes from the global generator
    batch = logits_row.expand(draws, -1)
    return Counter(full_sampler().sample(batch, requests_for(params, draws)))


def assert_frequencies_match(counts: Counter[int], expected: dict[int, float]) -> None:
    """Every token's empirical frequency is within 5 standard errors of its probability."""
    draws = sum(counts.values())
    assert set(counts) <= {token for token, p in expected.items() if p > 0}
    for token, p in expected.items():
        standard_error = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) <= 5 * standard_error + 1e-12, (token, p)


# --- greedy -----------------------------------------------------------------------------------

def test_temperature_zero_is_argmax_for_any_float_dtype() -> None:
    logits = random_logits(16, seed=0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cast = logits.to(dtype)
        chosen = full_sampler().sample(cast, requests_for(SamplingParams(temperature=0.0), 16))
        assert chosen == cast.argmax(dim=-1).tolist()


def test_top_k_one_is_argmax_at_temperature_one() -> None:
    logits = random_logits(64, seed=1, scale=0.1)  # flat logits: real sampling would wander
    chosen = full_sampler().sample(logits, requests_for(SamplingParams(temperature=1.0, top_k=1), 64))
    assert chosen == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.5),
])
def test_sampling_does_not_modify_callers_logits(params: SamplingParams) -> None:
    logits = random_logits(4, seed=2)
    original = logits.clone()
    full_sampler().sample(logits, [FakeRequest(params, [1, 2], [3, 3]) for _ in range(4)])
    assert torch.equal(logits, original)


# --- the sampled distribution -----------------------------------------------------------------

def test_frequencies_match_softmax_of_tempered_logits() -> None:
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -1.0])
    logits = torch.full((VOCAB,), -math.inf)
    logits[: len(base)] = base
    temperature = 0.7
    expected = torch.softmax(base / temperature, dim=0)
    counts = draw_many(logits, SamplingParams(temperature=temperature), draws=20_000)
    assert_frequencies_match(counts, {t: p.item() for t, p in enumerate(expected)})


def test_seeded_frequencies_match_softmax() -> None:
    """Seeded rows draw their own noise; that path must sample the same distribution."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = logits_from_probs(probs, [7, 3, 40, 11])[None]
    request = FakeRequest(SamplingParams(seed=99))
    counts = Counter(full_sampler().sample(logits, [request])[0] for _ in range(3000))
    assert_frequencies_match(counts, dict(zip([7, 3, 40, 11], probs)))


def test_top_k_samples_only_and_all_of_the_top_k() -> None:
    logits = random_logits(1, seed=3, scale=0.5)[0]
    k = 5
    top = set(logits.topk(k).indices.tolist())
    counts = draw_many(logits, SamplingParams(top_k=k), draws=5000)
    assert set(counts) == top


def test_top_p_samples_the_nucleus_renormalised() -> None:
    # Cumulative mass 0.4, 0.7, 0.9, 1.0: top_p 0.75 needs the first three tokens.
    probs = [0.4, 0.3, 0.2, 0.1]
    positions = [12, 30, 2, 45]  # scattered, so vocab order differs from probability order
    counts = draw_many(logits_from_probs(probs, positions), SamplingParams(top_p=0.75), 20_000)
    nucleus_mass = sum(probs[:3])
    expected = {pos: p / nucleus_mass for pos, p in zip(positions[:3], probs[:3])}
    expected[positions[3]] = 0.0
    assert set(counts) == set(positions[:3])
    assert_frequencies_match(counts, expected)


def test_top_p_keeps_the_top_token_even_when_it_alone_exceeds_top_p() -> None:
    logits = logits_from_probs([0.6, 0.4], [5, 6])
    assert set(draw_many(logits, SamplingParams(top_p=0.1), draws=500)) == {5}


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # After top_k=2 the pair renormalises to 0.6/0.4, so top_p=0.55 keeps only the first;
    # on the full distribution (0.3, 0.2, ...) it would have kept more than one token.
    probs = [0.3, 0.2, 0.2, 0.15, 0.15]
    logits = logits_from_probs(probs, [1, 2, 3, 4, 5])
    assert set(draw_many(logits, SamplingParams(top_k=2, top_p=0.55), draws=500)) == {1}


def test_min_p_excludes_tokens_below_the_scaled_top_probability() -> None:
    probs = [0.5, 0.3, 0.12, 0.05, 0.03]
    positions = [9, 8, 7, 6, 5]
    min_p = 0.2  # threshold 0.1: keeps 0.5, 0.3, 0.12
    counts = draw_many(logits_from_probs(probs, positions), SamplingParams(min_p=min_p), 20_000)
    kept = [(pos, p) for pos, p in zip(positions, probs) if p >= min_p * max(probs)]
    kept_mass = sum(p for _, p in kept)
    expected = {pos: 0.0 for pos in positions} | {pos: p / kept_mass for pos, p in kept}
    assert set(counts) == {pos for pos, _ in kept}
    assert_frequencies_match(counts, expected)


# --- seeds ------------------------------------------------------------------------------------

def run_steps(seeded_params: SamplingParams, companions: list[SamplingParams], row: int,
              steps: int = 30) -> list[int]:
    """Tokens the seeded request gets over `steps` steps, placed at `row` among `companions`."""
    seeded = FakeRequest(seeded_params)
    others = [FakeRequest(p, prompt_token_ids=[0, 1, 2]) for p in companions]
    batch = others[:row] + [seeded] + others[row:]
    sampler = full_sampler()
    tokens = []
    for step in range(steps):
        # The seeded request sees the same logits every run; companions see different ones.
        logits = random_logits(len(batch), seed=1000 + step * 7 + len(batch), scale=1.0)
        logits[row] = random_logits(1, seed=step, scale=1.0)[0]
        tokens.append(sampler.sample(logits, batch)[row])
        for request in batch:
            request.output_token_ids.append(tokens[-1])
    return tokens


def test_seeded_request_is_independent_of_batch_companions_and_row() -> None:
    params = SamplingParams(temperature=0.9, seed=42)
    alone = run_steps(params, [], row=0)
    layouts = [
        ([SamplingParams()], 1),
        ([SamplingParams(temperature=0.0), SamplingParams(top_k=3)], 1),
        ([SamplingParams(top_p=0.5, seed=7), SamplingParams(min_p=0.3),
          SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)], 2),
        ([SamplingParams(seed=42)] * 3, 3),
    ]
    for companions, row in layouts:
        assert run_steps(params, companions, row) == alone


def test_seeded_filters_are_reproducible_alongside_companions() -> None:
    params = SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, seed=5,
                            presence_penalty=0.3)
    alone = run_steps(params, [], row=0)
    assert run_steps(params, [SamplingParams(), SamplingParams(temperature=0.0)], row=1) == alone


def test_different_seeds_give_different_sequences() -> None:
    flat = torch.zeros(1, VOCAB)
    sequences = []
    for seed in (1, 2):
        request = FakeRequest(SamplingParams(seed=seed))
        sequences.append([full_sampler().sample(flat, [request])[0] for _ in range(50)])
    assert sequences[0] != sequences[1]


def test_seed_without_generator_is_rejected() -> None:
    request = FakeRequest(SamplingParams(seed=3))
    request.generator = None
    with pytest.raises(ValueError, match="generator"):
        full_sampler().sample(torch.zeros(1, VOCAB), [request])


# --- penalties --------------------------------------------------------------------------------

def greedy_token(logits_row: torch.Tensor, params: SamplingParams, prompt: list[int],
                 output: list[int]) -> int:
    request = FakeRequest(params, prompt_token_ids=prompt, output_token_ids=output)
    return full_sampler().sample(logits_row[None], [request])[0]


def two_token_logits(first: float, second: float) -> torch.Tensor:
    row = torch.full((VOCAB,), -10.0)
    row[0], row[1] = first, second
    return row


@pytest.mark.parametrize("first,second,penalty", [
    (2.0, 1.5, 1.5),    # 2/1.5 = 1.33 < 1.5: flips to token 1
    (2.0, 1.5, 1.2),    # 2/1.2 = 1.67 > 1.5: stays
    (-1.0, -1.2, 1.5),  # negative logit is multiplied: -1.5 < -1.2, flips
    (-1.0, -1.2, 1.1),  # -1.1 > -1.2: stays
    (1.0, 1.5, 0.5),    # penalty < 1 rewards repetition: 2.0 > 1.5, token 0 wins
])
@pytest.mark.parametrize("where_seen", ["prompt", "output"])
def test_repetition_penalty_follows_the_hf_formula(first: float, second: float, penalty: float,
                                                   where_seen: str) -> None:
    penalised_first = first / penalty if first > 0 else first * penalty
    expected = 0 if penalised_first > second else 1
    history = {"prompt": ([0], []), "output": ([], [0])}[where_seen]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert greedy_token(two_token_logits(first, second), params, *history) == expected


@pytest.mark.parametrize("frequency,presence,expected", [
    (0.4, 0.0, 1),   # 3 - 0.4 * 3 = 1.8 < 2
    (0.3, 0.0, 0),   # 3 - 0.3 * 3 = 2.1 > 2
    (0.0, 1.5, 1),   # 3 - 1.5 = 1.5 < 2
    (0.0, 0.5, 0),   # 3 - 0.5 = 2.5 > 2
    (0.2, 0.5, 1),   # 3 - 0.6 - 0.5 = 1.9 < 2
])
def test_presence_and_frequency_penalties_follow_the_openai_formula(
        frequency: float, presence: float, expected: int) -> None:
    output = [0, 0, 0, 5]
    count = output.count(0)
    assert (3.0 - frequency * count - presence * (count > 0) > 2.0) == (expected == 0)
    params = SamplingParams(temperature=0.0, frequency_penalty=frequency, presence_penalty=presence)
    assert greedy_token(two_token_logits(3.0, 2.0), params, [], output) == expected


def test_presence_and_frequency_penalties_ignore_the_prompt() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert greedy_token(two_token_logits(3.0, 2.0), params, [0, 0, 0], []) == 0


def test_negative_presence_penalty_encourages_seen_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=-1.5)
    assert greedy_token(two_token_logits(3.0, 2.0), params, [], [1]) == 1


def test_penalties_apply_only_to_the_rows_that_ask_for_them() -> None:
    logits = two_token_logits(3.0, 2.0).expand(2, -1)
    penalised = FakeRequest(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [0])
    plain = FakeRequest(SamplingParams(temperature=0.0), [0], [0])
    assert full_sampler().sample(logits, [penalised, plain]) == [1, 0]


# --- mixed batches ----------------------------------------------------------------------------

def test_mixed_batch_rows_follow_their_own_params() -> None:
    torch.manual_seed(0)
    logits = random_logits(4, seed=11, scale=1.0)
    greedy, top_k, top_p = (SamplingParams(temperature=0.0), SamplingParams(top_k=3),
                            SamplingParams(temperature=1.5, top_p=0.3))
    seeded = SamplingParams(temperature=0.8, seed=123)
    seeded_alone = full_sampler().sample(logits[3:4], [FakeRequest(seeded)])[0]

    top_k_set = set(logits[1].topk(3).indices.tolist())
    probs = torch.softmax(logits[2] / top_p.temperature, dim=0)
    ranked = probs.argsort(descending=True)
    mass_before = probs[ranked].cumsum(0) - probs[ranked]
    nucleus = set(ranked[mass_before < top_p.top_p].tolist())

    nucleus_draws = set()
    for _ in range(200):
        batch = [FakeRequest(p) for p in (greedy, top_k, top_p, seeded)]  # fresh generator
        g, k, p, s = full_sampler().sample(logits, batch)
        assert g == logits[0].argmax().item()
        assert k in top_k_set
        assert s == seeded_alone
        nucleus_draws.add(p)
    assert nucleus_draws <= nucleus
    assert len(nucleus_draws) > 1  # the top-p row really samples


# --- parameter validation ---------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("temperature", -0.1), ("temperature", "1.0"), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", True), ("max_tokens", 8.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", ["ok", 3]),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", ["a"]), ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("seed", 1.5), ("seed", True), ("seed", 2**64),
    # Integers beyond a float's range (once an OverflowError, not a ValueError).
    *[(name, 10**400) for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty")],
    ("logit_bias", {1: 10**400}),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", "x" * (MAX_STOP_STRING_CHARS + 1)),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
])
def test_invalid_params_raise_with_the_parameter_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [
    ("temperature", 0.0), ("top_p", 1.0), ("top_p", 1e-6), ("top_k", 0), ("min_p", 0.0),
    ("min_p", 1.0), ("max_tokens", 1), ("repetition_penalty", 0.01),
    ("presence_penalty", -2.0), ("frequency_penalty", 2.0), ("seed", 0), ("seed", -1),
])
def test_boundary_params_are_accepted(name: str, value: object) -> None:
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_stop_limits_are_inclusive() -> None:
    params = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert len(params.stop) == MAX_STOP_STRINGS


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == []
    assert SamplingParams().stop_token_ids == []


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_settings_left_out_wait_for_the_models_defaults() -> None:
    """Left out (None), a defaultable setting holds its neutral value until `with_defaults`
    fills it; one given stays as given, even when it equals the neutral value."""
    params = SamplingParams(temperature=1.0, top_k=None, max_tokens=3)
    assert params.top_k == 0 and params.unset == {"top_p", "top_k", "min_p", "repetition_penalty"}
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    filled = params.with_defaults(model)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p) == (1.0, 0.95, 20, 0.0)
    assert filled.unset == frozenset() and filled.with_defaults({"top_k": 5}) is filled
    # A model's recommended values are checked once, when the engine starts, and a bad
    # one is named as a caller's would be.
    with pytest.raises(ValueError, match="top_p"):
        check_defaults({"top_p": 0.0})
    with pytest.raises(ValueError, match="unknown sampling defaults"):
        check_defaults({"beam_width": 4})
