"""The decode-bucket runner on the CPU.

Without a GPU the runner still pads decode steps to a bucket and copies them through its
static buffers before calling the model, so these tests cover what CUDA graphs rely on:
which bucket a batch gets, that padding rows only ever touch the scratch page, and that
none of it changes a single output token. Capture and replay are in
`test_cuda_flashinfer.py`; the choice of attention backend is in `test_cuda_host.py`.
"""

import random
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import check_page_accounting, greedy, random_prompts, run_to_completion

from nanoqwen import LLMEngine
from nanoqwen.attention.flashinfer_backend import FlashInferBackend
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.config import EngineConfig
from nanoqwen.memory.page_allocator import SCRATCH_PAGE
from nanoqwen.runner.cuda_graph import MAX_BUCKET, decode_buckets, default_buckets

VOCAB = 800
BUCKETS = [1, 2, 4, 8, 16, 24]


class Step(NamedTuple):
    sampled: int  # requests sampled this step
    rows: int  # rows the model ran, padding included
    decode: bool  # every row had one new token


def record_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Log every forward pass of `engine` (until the test ends)."""
    steps: list[Step] = []
    forward = engine.runner.forward

    def logged(inputs):
        metadata = inputs.metadata
        steps.append(Step(len(inputs.sampled), metadata.batch_size, metadata.max_q_len == 1))
        return forward(inputs)

    monkeypatch.setattr(engine.runner, "forward", logged)
    return steps


def expected_rows(num_decodes: int) -> int:
    """The smallest bucket holding the batch; above the largest, the batch as it is."""
    return next((size for size in BUCKETS if size >= num_decodes), num_decodes)


def make_engine(model_dir: str, **options) -> LLMEngine:
    return LLMEngine(model_dir, device="cpu", max_num_seqs=32, num_pages=300, **options)


@pytest.fixture(scope="module")
def engine_pairs(qwen2_dir: str, qwen3_dir: str) -> dict[str, tuple[LLMEngine, LLMEngine]]:
    """Per model: an eager engine and one that pads decode steps to BUCKETS."""
    return {
        d: (make_engine(d), make_engine(d, decode_buckets=BUCKETS)) for d in (qwen2_dir, qwen3_dir)
    }


@pytest.fixture
def eager(engine_pairs, model_dir: str) -> LLMEngine:
    return engine_pairs[model_dir][0]


@pytest.fixture
def bucketed(engine_pairs, model_dir: str) -> LLMEngine:
    return engine_pairs[model_dir][1]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, max_tokens)]
    final = run_to_completion(engine)
    return [final[i].token_ids for i in ids]


# ----------------------------------------------------------------- bucket choice
def test_default_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(3) == [1, 2, 4]
    assert default_buckets(17) == [1, 2, 4, 8, 16, 24]
    assert default_buckets(24) == [1, 2, 4, 8, 16, 24]
    everything = default_buckets(10_000)
    assert everything[:6] == [1, 2, 4, 8, 16, 24] and everything[-1] == MAX_BUCKET
    assert all(b - a == 8 for a, b in zip(everything[3:], everything[4:]))


def test_buckets_are_on_where_graphs_can_be_captured(qwen3_dir: str) -> None:
    engine = make_engine(qwen3_dir)
    model_config = engine.model_config
    assert engine.runner.graphs is None  # CPU default

    cuda = torch.device("cuda")  # the policy only reads it; nothing runs there
    rope = model_config.rope_type
    assert decode_buckets(None, 32, cuda, FlashInferBackend, rope) == default_buckets(32)
    assert decode_buckets(None, 32, cuda, TorchBackend, rope) == []
    assert decode_buckets(None, 32, cuda, FlashInferBackend, "dynamic") == []

    asked = EngineConfig(model="m", device="cpu", decode_buckets=[8, 1, 4, 4]).decode_buckets
    cpu = torch.device("cpu")
    assert decode_buckets(asked, 32, cpu, TorchBackend, rope) == [1, 4, 8]
    # Asked for and forbidden at once, no step is padded.
    eager = make_engine(qwen3_dir, decode_buckets=[1, 2], enforce_eager=True)
    assert eager.runner.graphs is None


@pytest.mark.parametrize("buckets", [[0], [1, -8], [2.5]])
def test_bad_buckets_raise(buckets: list) -> None:
    with pytest.raises(ValueError, match="decode_buckets"):
        EngineConfig(model="m", device="cpu", decode_buckets=buckets)


# ----------------------------------------------------------------- padding and outputs
@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3, 5, 17, 25])
def test_padded_decodes_match_the_eager_path(
    eager: LLMEngine, bucketed: LLMEngine, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At least 2 tokens each, so the first step is a prefill, not decode-shaped.
    rng = random.Random(batch_size)
    lengths = [rng.randint(2, 19) for _ in range(batch_size)]
    prompts = random_prompts(VOCAB, lengths, seed=batch_size)
    steps = record_steps(bucketed, monkeypatch)
    max_tokens = [6] * batch_size
    assert generate(bucketed, prompts, max_tokens) == generate(eager, prompts, max_tokens)
    decodes = [step for step in steps if step.decode]
    assert len(decodes) == 5  # one prefill step, then the 5 remaining tokens
    assert all(step == Step(batch_size, expected_rows(batch_size), True) for step in decodes)


def test_padding_rows_write_only_the_scratch_page(eager: LLMEngine, bucketed: LLMEngine) -> None:
    # No prompt ends on a page boundary, so the decode step needs no new page.
    prompts = random_prompts(VOCAB, [5, 9, 20], seed=7)
    for engine in (eager, bucketed):
        pool = engine.runner.kv_cache
        for prompt in prompts:
            engine.add_request(prompt, greedy(3))
        engine.step()  # the prefill
        requests = list(engine.requests.values())
        new_slots = {
            r.pages[r.num_computed_tokens // pool.page_size] * pool.page_size
            + r.num_computed_tokens % pool.page_size
            for r in requests
        }
        pool.kv[:, :, SCRATCH_PAGE] = 0
        before = pool.kv.clone()
        engine.step()  # 3 decodes: padded to 4 rows in the bucketed engine
        written = (pool.kv != before).any(dim=(0, 1, 4, 5)).flatten()  # per pool slot
        written_slots = set(written.nonzero().flatten().tolist())
        scratch = set(range(SCRATCH_PAGE * pool.page_size, (SCRATCH_PAGE + 1) * pool.page_size))
        assert written_slots - scratch == new_slots
        # Every padding row is the same one-token sequence, in slot 0 of the scratch page.
        padding_slots = {SCRATCH_PAGE * pool.page_size} if engine is bucketed else set()
        assert written_slots & scratch == padding_slots
        run_to_completion(engine)


@pytest.mark.slow
def test_requests_joining_and_leaving_change_buckets(
    eager: LLMEngine, bucketed: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(VOCAB, [3 + 2 * i for i in range(20)], seed=11)
    max_tokens = [2 + i % 9 for i in range(20)]
    steps = record_steps(bucketed, monkeypatch)
    outputs = {}
    for engine in (eager, bucketed):
        ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts[:10], max_tokens[:10])]
        final = {}
        for _ in range(3):
            final.update({out.request_id: out for out in engine.step() if out.finished})
        ids += [engine.add_request(p, greedy(n)) for p, n in zip(prompts[10:], max_tokens[10:])]
        final.update(run_to_completion(engine))
        outputs[engine] = [final[i].token_ids for i in ids]
    assert outputs[bucketed] == outputs[eager]
    decodes = [step for step in steps if step.decode]
    assert all(step.rows == expected_rows(step.sampled) for step in decodes)
    assert len({step.rows for step in decodes}) >= 3, "the batch never changed bucket"


# ----------------------------------------------------------------- random workloads
@pytest.fixture(scope="module")
def tight_pair(qwen2_dir: str) -> tuple[LLMEngine, LLMEngine]:
    """A pool so small that requests are preempted and cached pages evicted."""
    options = dict(device="cpu", num_pages=30, page_size=4, chunk_size=24, max_num_seqs=12)
    eager = LLMEngine(qwen2_dir, **options)
    return eager, LLMEngine(qwen2_dir, decode_buckets=[1, 2, 4, 8], **options)


WORKLOADS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 10), st.integers(0, 3)),
    min_size=1,
    max_size=14,
)


@pytest.mark.slow
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=WORKLOADS, seed=st.integers(0, 1000))
def test_scratch_page_is_never_handed_out(tight_pair, workload, seed: int) -> None:
    """Requests (prompt from a shared prefix, length, max tokens) arrive between steps."""
    prefixes = random_prompts(VOCAB, [0, 5, 9, 14], seed=seed)
    tails = random_prompts(VOCAB, [length for _, length, _, _ in workload], seed=seed + 1)
    prompts = [prefixes[arrival[0]] + tail for arrival, tail in zip(workload, tails)]
    outputs = []
    for engine in tight_pair:
        ids, final = [], {}
        for prompt, (_, _, max_tokens, steps_before) in zip(prompts, workload):
            for _ in range(steps_before):
                final.update({out.request_id: out for out in engine.step() if out.finished})
                check_page_accounting(engine)  # the scratch page is nobody's, nor free
            ids.append(engine.add_request(prompt, greedy(max_tokens)))
        final.update(run_to_completion(engine))
        outputs.append([final[i].token_ids for i in ids])
        assert engine.allocator.ref_counts[SCRATCH_PAGE] == 0
    assert outputs[0] == outputs[1]
