"""How the torch backend splits a step's attention into calls, and what they cost in memory.

The torch backend (`torch_backend.py`) copies keys and values out of the KV cache and hands
SDPA score matrices to build. On a CPU's steps that is megabytes; at a GPU's scale it is
not: 256 sequences decoding at 40,960 tokens each, beside an 8,192-token prefill chunk,
would gather hundreds of gigabytes into one call. So before any tensor is made, the step
is laid out on the host, from nothing but its query and KV lengths:

* **fresh prompts** (nothing cached) attend their own new keys, one causal SDPA call each;
* **decodes** of an unquantized cache read it in place, all in one sparse product
  (`SparseDecodeGroup`);
* **the rest** (prefill chunks over a cached prefix, rows verifying proposed tokens,
  decodes of a quantized cache) are gathered into padded batches for SDPA. Requests are
  batched with others of a similar query length (the same power-of-two class: a decode is
  never padded to a prefill chunk's length), longest context first, and each class is
  cut into slices: as many requests as fit in `MAX_CALL_BYTES`, or, for one request that does
  not fit alone, a range of its queries (which need only the keys up to the last of them).

`MAX_CALL_BYTES` bounds every call: a fresh prompt or a sparse product that would need more
is attended in padded slices instead. So what a step can need beside the KV cache is known
from its lengths alone (`step_bytes`): the start-up sizing reserves it for the largest step
a schedule can make (`runner/memory_profile.py`), and the backend allocates no more.

The costs are upper bounds of what torch allocates. SDPA with a mask and grouped query
heads runs on CUDA in its math kernel (flash attention takes no mask, the memory-efficient
one no grouped heads): it repeats the keys and values for every query head, computes in
float32 and builds the score matrix, its softmax and a float copy of the mask whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# What one call (an SDPA call with its gathered pages, or the sparse decodes) may allocate.
MAX_CALL_BYTES = 2 << 30
FLOAT32 = 4
INDEX = 8  # int64
# Per (query, key, head): SDPA's float32 scores, masked scores and softmax.
SCORE_BYTES = 3 * FLOAT32


@dataclass(frozen=True)
class AttentionCosts:
    """Bytes per unit of attention work, for one model's heads (on this rank) and cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype_bytes: int  # of the dtype attention computes in
    gathers_keys: bool  # decodes' keys are copied to float32 for the sparse product
    quantized: bool  # pages are dequantized when gathered, and no decode is sparse

    # ------------------------------------------------------------ padded slices
    def slice_workspace(self, batch: int, pages: int) -> int:
        """The gathered keys and values of `batch` requests of `pages` pages each."""
        return 2 * batch * pages * self._page_numbers * self.dtype_bytes

    def slice_scratch(self, batch: int, queries: int, pages: int) -> int:
        """What one SDPA call on such a slice allocates, and frees, beside its workspace."""
        keys = batch * pages * self.page_size
        head_numbers = keys * self.num_heads * self.head_dim
        # Keys and values repeated for every query head, then in float32.
        repeated = 2 * head_numbers * (self.dtype_bytes + FLOAT32)
        # Dequantizing one kind of pages: the codes, in float32, scaled, in the dtype.
        dequantized = (
            batch * pages * self._page_numbers * (1 + 2 * FLOAT32 + self.dtype_bytes)
            if self.quantized
            else 0
        )
        scores = batch * queries * keys * (self.num_heads * SCORE_BYTES + FLOAT32)
        # The queries gathered and in float32, the output in float32 and copied back.
        query_numbers = batch * queries * self.num_heads * self.head_dim
        outputs = query_numbers * (3 * self.dtype_bytes + 2 * FLOAT32)
        return repeated + dequantized + scores + outputs

    def slice_plan(self, batch: int, queries: int, pages: int) -> int:
        """What the plan keeps for the step: the slice's mask, page table and row indices."""
        keys = pages * self.page_size
        return batch * (queries * keys + pages * INDEX + 3 * queries * INDEX)

    def slice_bytes(self, batch: int, queries: int, pages: int) -> int:
        return (
            self.slice_workspace(batch, pages)
            + self.slice_scratch(batch, queries, pages)
            + self.slice_plan(batch, queries, pages)
        )

    # ------------------------------------------------------------ fresh prompts
    def fresh_bytes(self, length: int) -> int:
        """One causal SDPA call of a prompt over its own keys (and the causal mask SDPA's
        math kernel builds)."""
        return self.slice_scratch(1, length, -(-length // self.page_size)) + length**2

    # ------------------------------------------------------------ sparse decodes
    def sparse_bytes(self, kv_lens: list[int]) -> int:
        """Everything the sparse product of these decodes allocates (plan and forward)."""
        entries = self.num_heads * sum(kv_lens)  # one per (request, head, visible key)
        dense = len(kv_lens) * self.num_heads * max(kv_lens)  # rows padded to the longest
        value = FLOAT32 if self.gathers_keys else 2 * FLOAT32  # float32, or float64
        # Kept by the plan: each entry's place in the dense rows, its value and key
        # columns, its score; the dense rows. Built with [B, heads, max_kv] temporaries.
        plan = entries * (3 * INDEX + value) + dense * (value + 2 * INDEX + 1)
        # Per layer: the softmax, the weights picked out and cast, the bag of each entry.
        forward = dense * value + entries * (value + self.dtype_bytes + INDEX)
        pages = sum(-(-kv_len // self.page_size) for kv_len in kv_lens)
        gathered = pages * self._page_numbers * (self.dtype_bytes + FLOAT32)
        return plan + forward + (gathered if self.gathers_keys else 0)

    @property
    def _page_numbers(self) -> int:
        """Numbers in one page of one layer's keys (or values)."""
        return self.page_size * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class PaddedSlice:
    """Requests attended by one SDPA call: queries `first_query ..` (`num_queries` of
    them, padded) of each, over their first `num_pages` pages (padded)."""

    requests: tuple[int, ...]  # indices into the step's batch
    first_query: int
    num_queries: int
    num_pages: int


@dataclass(frozen=True)
class StepLayout:
    """Which call attends each request of a step (indices into its batch)."""

    fresh: list[int]
    sparse: list[int]
    padded: list[PaddedSlice]


def lay_out(
    costs: AttentionCosts, q_lens: list[int], kv_lens: list[int], cap: int = MAX_CALL_BYTES
) -> StepLayout:
    """Lay a step out (see the module docstring) so that no call needs more than `cap`
    bytes, one request's whole keys for one query excepted."""
    fresh, decodes, padded = [], [], []
    for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if 1 < q_len == kv_len and costs.fresh_bytes(q_len) <= cap:
            fresh.append(request)
        elif q_len == 1 and not costs.quantized:
            decodes.append(request)
        else:
            padded.append(request)
    if decodes and costs.sparse_bytes([kv_lens[r] for r in decodes]) > cap:
        padded, decodes = padded + decodes, []
    classes: dict[int, list[int]] = {}
    for request in sorted(padded, key=lambda r: -kv_lens[r]):
        classes.setdefault((q_lens[request] - 1).bit_length(), []).append(request)
    slices = [
        piece
        for members in classes.values()
        for piece in _cut(costs, members, q_lens, kv_lens, cap)
    ]
    return StepLayout(fresh, decodes, slices)


def _cut(
    costs: AttentionCosts, members: list[int], q_lens: list[int], kv_lens: list[int], cap: int
) -> list[PaddedSlice]:
    """Slices of one class's requests (longest context first), each within `cap`."""
    slices, start = [], 0
    while start < len(members):
        pages = -(-kv_lens[members[start]] // costs.page_size)  # the slice's longest

        def fits(count: int) -> bool:
            queries = max(q_lens[r] for r in members[start : start + count])
            return costs.slice_bytes(count, queries, pages) <= cap

        count = _most_that_fit(len(members) - start, fits)
        if count > 1 or fits(1):
            batch = tuple(members[start : start + count])
            slices.append(PaddedSlice(batch, 0, max(q_lens[r] for r in batch), pages))
        else:
            slices += _query_ranges(costs, members[start], q_lens, kv_lens, pages, cap)
        start += count
    return slices


def _query_ranges(
    costs: AttentionCosts, request: int, q_lens: list[int], kv_lens: list[int], pages: int,
    cap: int,
) -> list[PaddedSlice]:
    """One request too large for one call, in ranges of its queries, each with the pages
    up to its last query's position."""
    q_len, kv_len = q_lens[request], kv_lens[request]
    width = _most_that_fit(q_len, lambda n: costs.slice_bytes(1, n, pages) <= cap)
    ranges = []
    for first in range(0, q_len, width):
        count = min(width, q_len - first)
        last_position = kv_len - q_len + first + count - 1
        ranges.append(PaddedSlice((request,), first, count, last_position // costs.page_size + 1))
    return ranges


def _most_that_fit(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 1..limit with `fits(n)` (`fits` holds for all n up to some point),
    and 1 if none does."""
    low, high = 1, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def step_bytes(
    costs: AttentionCosts, q_lens: list[int], kv_lens: list[int], cap: int = MAX_CALL_BYTES
) -> int:
    """The most memory the torch backend allocates at once, beside the KV cache, for a step
    of these query and KV lengths: what its plan keeps, the workspaces its gathers fill
    (kept from call to call), the sparse decodes' all, and the largest other call's."""
    layout = lay_out(costs, q_lens, kv_lens, cap)
    padded = [(len(s.requests), s.num_queries, s.num_pages) for s in layout.padded]
    plan = sum(costs.slice_plan(*shape) for shape in padded)
    workspace = max((costs.slice_workspace(batch, pages) for batch, _, pages in padded), default=0)
    sparse = costs.sparse_bytes([kv_lens[r] for r in layout.sparse]) if layout.sparse else 0
    scratch = [costs.slice_scratch(*shape) for shape in padded]
    scratch += [costs.fresh_bytes(q_lens[r]) for r in layout.fresh]
    return plan + workspace + sparse + max(scratch, default=0)
