"""The attention backends on random page tables, each held to a simpler one.

`ReferenceBackend` is checked against the formula itself, written out in float64: for each
request, each new token and each head, softmax(q·k / sqrt(d)) over the keys at or before
its position, times the values. `TorchBackend`, which attends decodes as sparse matrix
products (straight from the pool in float32 and float64, from pages gathered into float32
otherwise), fresh prompts causally over their own new keys, and prefills with cached keys
by gathering pages into a padded batch for SDPA, is then checked against
`ReferenceBackend`. The engine-level tests compare whole models against transformers;
these pin the backends down, including the paths (bfloat16 decodes, odd head groupings,
page size 1) that the tiny models don't reach.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from steps import step_of

from nanoqwen.attention.base import AttentionBackend, ReferenceBackend
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.runner.runner import StepInputs
from nanoqwen.runner.startup import make_kv_cache

HEAD_DIM = 16
# A step's rows: (tokens already cached, new tokens) per request.
Row = tuple[int, int]


def random_step(pool: KVCache, rows: list[Row], seed: int) -> tuple[StepInputs, list[list[int]]]:
    """A step over `rows`, each request on distinct random pages; also each one's pages."""
    rng = random.Random(seed)
    free = list(range(1, pool.num_pages))
    rng.shuffle(free)
    hand_rows, all_pages = [], []
    for cached, new in rows:
        pages = [free.pop() for _ in range(-(-(cached + new) // pool.page_size))]
        hand_rows.append((cached, [0] * new, pages, 1))
        all_pages.append(pages)
    return step_of(hand_rows, pool.page_size, pool.kv.device), all_pages


def formula_attention(
    pool: KVCache, rows: list[Row], pages: list[list[int]], q: torch.Tensor
) -> torch.Tensor:
    """Each new token of each request attends, head by head, to its request's keys."""
    k_cache, v_cache = (cache.flatten(0, 1) for cache in pool.layer_cache(0))
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out, row = torch.empty_like(q), 0
    for (cached, new), request_pages in zip(rows, pages):
        page_starts = [page * pool.page_size for page in request_pages]
        slots = [start + offset for start in page_starts for offset in range(pool.page_size)]
        visible = slots[: cached + new]  # the request's slots, in position order
        keys, values = k_cache[visible].double(), v_cache[visible].double()
        for token in range(new):
            position = cached + token
            for head in range(num_heads):
                kv_head = head // (num_heads // num_kv_heads)
                query = q[row + token, head].double()
                scores = keys[: position + 1, kv_head] @ query / HEAD_DIM**0.5
                weights = scores.softmax(dim=0)
                out[row + token, head] = (weights @ values[: position + 1, kv_head]).to(q.dtype)
        row += new
    return out


def attend(
    backend_class: type[AttentionBackend],
    rows: list[Row],
    num_heads: int,
    num_kv_heads: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[AttentionBackend, torch.Tensor, torch.Tensor]:
    """A backend's output for one random step, and the written-out formula's."""
    torch.manual_seed(seed)
    num_pages = sum(-(-(cached + new) // page_size) for cached, new in rows) + 1
    pool = KVCache(1, num_kv_heads, HEAD_DIM, page_size, num_pages, dtype, torch.device("cpu"))
    pool.kv.normal_()
    inputs, pages = random_step(pool, rows, seed)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(2, num_tokens, num_kv_heads, HEAD_DIM, dtype=dtype)
    backend = backend_class(pool, num_heads, num_kv_heads, HEAD_DIM)
    backend.plan(inputs.metadata)
    out = backend.forward(0, q, k, v)
    return backend, out, formula_attention(pool, rows, pages, q)


def attend_both(
    rows: list[Row], heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int
) -> tuple[TorchBackend, torch.Tensor, torch.Tensor]:
    """TorchBackend's output for one random step, and ReferenceBackend's on the same data."""
    backend, out, _ = attend(TorchBackend, rows, *heads, page_size, dtype, seed)
    _, reference, _ = attend(ReferenceBackend, rows, *heads, page_size, dtype, seed)
    return backend, out, reference


TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
HEADS = [(4, 4), (4, 2), (6, 2), (4, 1)]


ROWS = st.lists(
    # Decodes (one new token) often, to mix them with prefills in one step.
    st.tuples(st.integers(0, 40), st.one_of(st.just(1), st.integers(1, 20))),
    min_size=1,
    max_size=6,
)


@settings(max_examples=30, deadline=None)
@given(
    rows=ROWS,
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(list(TOLERANCE)),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_the_formula(
    rows: list[Row], heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int
) -> None:
    _, out, expected = attend(ReferenceBackend, rows, *heads, page_size, dtype, seed)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@settings(max_examples=60, deadline=None)
@given(
    rows=ROWS,
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(list(TOLERANCE)),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_matches_the_reference(
    rows: list[Row], heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int
) -> None:
    _, out, reference = attend_both(rows, heads, page_size, dtype, seed)
    torch.testing.assert_close(out, reference, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kind_of_request_takes_its_own_path(dtype: torch.dtype) -> None:
    rows = [(30, 1), (0, 12), (5, 1), (17, 9), (0, 1), (0, 3)]
    backend, out, reference = attend_both(rows, (6, 2), 4, dtype, seed=0)
    decodes, [padded] = backend.decodes, backend.padded
    assert decodes is not None
    assert decodes.query_rows.tolist() == [0, 13, 23]  # the one-token rows
    # Low precision: the decodes' pages (8, 2 and 1 of them) are gathered, each once.
    gathered = decodes.gathered_pages
    assert (gathered is None) == (dtype == torch.float32)
    if gathered is not None:
        assert gathered.numel() == 8 + 2 + 1
    assert backend.fresh_rows == [slice(1, 13), slice(24, 27)]  # nothing cached
    assert padded.output_rows.tolist() == list(range(14, 23))  # 17 cached, 9 new
    # Decodes read their values where they lie: only the padded group's are gathered.
    assert backend.value_workspace.shape[0] == padded.kv_pages.numel() == 7
    torch.testing.assert_close(out, reference, **TOLERANCE[dtype])


@pytest.mark.parametrize("backend_class", [ReferenceBackend, TorchBackend])
def test_new_keys_and_values_land_in_their_slots(backend_class: type[AttentionBackend]) -> None:
    rows = [(3, 1), (0, 5)]
    pool = KVCache(1, 2, HEAD_DIM, 4, 8, torch.float32, torch.device("cpu"))
    inputs, _ = random_step(pool, rows, seed=1)
    k, v = torch.randn(2, 6, 2, HEAD_DIM)
    backend = backend_class(pool, 4, 2, HEAD_DIM)
    backend.plan(inputs.metadata)
    backend.forward(0, torch.randn(6, 4, HEAD_DIM), k, v)
    k_cache, v_cache = (cache.flatten(0, 1) for cache in pool.layer_cache(0))
    slots = inputs.metadata.slot_mapping
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


# ----------------------------------------------------------------- grouping and slicing
class SmallCalls(TorchBackend):
    """The torch backend with room for small calls only: prompts and decodes go to padded
    groups, cut into single requests and ranges of queries."""

    max_call_bytes = 60_000


class MediumCalls(TorchBackend):
    max_call_bytes = 600_000


LONG_ROWS = st.lists(
    st.tuples(st.integers(0, 120), st.one_of(st.just(1), st.integers(1, 4), st.integers(1, 60))),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(
    rows=LONG_ROWS,
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(list(TOLERANCE)),
    backend_class=st.sampled_from([SmallCalls, MediumCalls]),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_in_bounded_calls_matches_the_reference(
    rows: list[Row], heads: tuple[int, int], page_size: int, dtype: torch.dtype,
    backend_class: type[TorchBackend], seed: int,
) -> None:
    backend, out, _ = attend(backend_class, rows, *heads, page_size, dtype, seed)
    _, reference, _ = attend(ReferenceBackend, rows, *heads, page_size, dtype, seed)
    torch.testing.assert_close(out, reference, **TOLERANCE[dtype])
    # Every new token was attended by exactly one call.
    covered = [r for group in backend.padded for r in group.output_rows.tolist()]
    covered += [r for rows_ in backend.fresh_rows for r in range(rows_.start, rows_.stop)]
    if backend.decodes is not None:
        covered += backend.decodes.query_rows.tolist()
    assert sorted(covered) == list(range(out.shape[0]))


def padded_shapes(backend: TorchBackend) -> list[tuple[int, int, int]]:
    """(requests, padded queries, padded keys) of each padded group."""
    return [tuple(group.mask.shape[i] for i in (0, 2, 3)) for group in backend.padded]


def test_decodes_of_a_quantized_cache_are_not_padded_to_a_prefill() -> None:
    """int8 pages have no sparse product: decodes are padded, in a group of their own, and
    rows verifying a few proposed tokens in another; no row is padded to the chunk."""
    rows = [(30, 1), (17, 40), (5, 1), (60, 3), (9, 4)]
    pool = make_kv_cache(1, 2, HEAD_DIM, 4, 64, torch.float32, torch.device("cpu"),
                         storage_dtype=torch.int8)
    inputs, _ = random_step(pool, rows, seed=0)
    backend = TorchBackend(pool, 4, 2, HEAD_DIM)
    backend.plan(inputs.metadata)
    assert backend.decodes is None and backend.fresh_rows == []
    # One group per query-length class, longest contexts first within each.
    assert sorted(padded_shapes(backend)) == [(1, 40, 60), (2, 1, 32), (2, 4, 64)]
    num_tokens = inputs.input_ids.numel()
    q, k, v = torch.randn(num_tokens, 4, HEAD_DIM), *torch.randn(2, num_tokens, 2, HEAD_DIM)
    out = backend.forward(0, q, k, v)
    reference = ReferenceBackend(pool, 4, 2, HEAD_DIM)
    reference.plan(inputs.metadata)
    torch.testing.assert_close(out, reference.forward(0, q, k, v), atol=1e-5, rtol=1e-4)


def test_a_long_prefill_is_attended_in_ranges_of_its_queries() -> None:
    """A chunk too large for one call is cut into ranges of its queries, each over the
    pages up to its last query's position, and the decodes beside it stay sparse."""
    rows = [(200, 120), (50, 1), (7, 1)]
    backend, out, reference = attend(MediumCalls, rows, 4, 2, 4, torch.float32, seed=3)
    assert backend.decodes is not None and backend.decodes.query_rows.tolist() == [120, 121]
    ranges = padded_shapes(backend)
    assert len(ranges) > 1 and all(batch == 1 for batch, _, _ in ranges)
    assert sum(queries for _, queries, _ in ranges) == 120
    keys = [num_keys for _, _, num_keys in ranges]
    assert keys == sorted(keys) and keys[0] < keys[-1] == 320  # later ranges see more keys
    torch.testing.assert_close(out, reference, **TOLERANCE[torch.float32])
