"""Recurrent state per request: a pool of fixed-size slots beside the paged KV cache.

A hybrid model's linear-attention layers (Gated DeltaNet, `model/gated_deltanet.py`) keep no
keys and values: each keeps, per request, a conv window (the last few inputs) and a
recurrent state matrix, of a size that never grows. So a request's memory there is not a
list of pages but one **slot**: index `s` of every such layer's `windows[s]` and
`recurrent[s]`. Two slots are special: slot 0 is a dummy that padding rows of a CUDA graph
write into, and slot 1 holds zeros, never written, the state of a request that has seen
nothing.

The pool is managed like the KV pages, in two halves:

* `StateSlots`, on the host (the scheduler's): which slot is whose. A request gets one
  private slot when admitted and frees it when it finishes or is preempted.
* `StateCache`, on the device (the runner's): the tensors, and the copies a step asks for.

Slots only move by **copies**, laid out with the step (`StateStep`): into a request's slot
before its first row (from the zero slot, or from a snapshot), and out of it after a row
that ends on a page boundary (a snapshot). That is how prefix caching survives a state
that cannot be shared: the radix tree reuses the K/V pages of a cached prefix, and a
**snapshot** — an immutable copy of the state after exactly those tokens, kept by token
prefix — gives the linear layers the state at the same point. A match is cut back to the
deepest page boundary that has a snapshot; a request copies the snapshot into its own slot,
never computing into a snapshot. Snapshots are evicted least recently used, whenever a
slot is needed; a prefix may keep its pages without a snapshot.

Invariants: free + running + snapshot slots == `num_slots` when nothing is in flight;
no two rows of a step share a slot; a snapshot's state is the state after its prefix.
The story: docs/learn/17-hybrid-attention.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

DUMMY_SLOT, ZERO_SLOT = 0, 1
FIRST_SLOT = 2
_clock = itertools.count()


class Request(Protocol):
    """What the pool reads and writes of a request (the scheduler's `Request`)."""

    token_ids: list[int]
    state_slot: int | None


@dataclass
class Snapshot:
    slot: int
    last_used: int
    saved: bool = False  # the step that saves it has run (a failed one never does)


class StateSlots:
    """Which slot is whose, on the host: free slots, running requests' slots, snapshots."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.num_slots, self.page_size = num_slots, page_size
        self.free = list(range(FIRST_SLOT + num_slots - 1, FIRST_SLOT - 1, -1))
        self.snapshots: dict[tuple[int, ...], Snapshot] = {}
        self.num_running = 0
        self.step_started = next(_clock)  # snapshots used since are this step's: kept

    def restore_point(self, tokens: list[int], num_cached_pages: int) -> tuple[int, int]:
        """How many of the cached pages a request with `tokens` may reuse (the deepest
        boundary with a snapshot), and the slot its state starts from there."""
        for pages in range(num_cached_pages, 0, -1):
            snapshot = self.snapshots.get(tuple(tokens[: pages * self.page_size]))
            if snapshot is not None and snapshot.saved:
                snapshot.last_used = next(_clock)
                return pages, snapshot.slot
        return 0, ZERO_SLOT

    def take(self, request: Request) -> bool:
        """A slot for a running request, evicting the least recently used snapshot if none is
        free; False if every slot is running."""
        if not self.free and not self._evict_one():
            return False
        request.state_slot = self.free.pop()
        self.num_running += 1
        return True

    def release(self, request: Request) -> None:
        self.free.append(request.state_slot)
        request.state_slot = None
        self.num_running -= 1

    def snapshot_slot(self, prefix: list[int]) -> int | None:
        """A slot to save the state after `prefix` into, kept as its snapshot; None when
        the prefix has one already or no slot can be spared (the state is simply not kept)."""
        key = tuple(prefix)
        if key in self.snapshots or (not self.free and not self._evict_one()):
            return None
        slot = self.free.pop()
        self.snapshots[key] = Snapshot(slot, next(_clock))
        return slot

    def chunk_end(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` cut so that a prompt's computing stops once at its last page boundary
        before its last token, where the state is saved for a later turn to start from."""
        boundary = (len(request.token_ids) - 1) // self.page_size * self.page_size
        return boundary - start if start < boundary < start + num_new else num_new

    def fill(self, row: Any, source: int | None) -> None:
        """A scheduled row's part of the pool: its request's slot, where that slot starts
        from (when the request is admitted) and, ending on a page boundary, a snapshot."""
        row.state_slot, row.state_source = row.request.state_slot, source
        end = row.start + len(row.token_ids)
        if end % self.page_size == 0:
            row.state_save = self.snapshot_slot(row.request.token_ids[:end])

    def saved(self, rows: Sequence[Any]) -> None:
        """The step that ran `rows` saved their snapshots: they may now be restored."""
        for row in rows:
            if row.state_save is not None:
                end = row.start + len(row.token_ids)
                self.snapshots[tuple(row.request.token_ids[:end])].saved = True

    def new_step(self) -> None:
        """Free the slots of snapshots a step meant to save and never did (it failed)."""
        self.step_started = next(_clock)
        for key in [key for key, snapshot in self.snapshots.items() if not snapshot.saved]:
            self.free.append(self.snapshots.pop(key).slot)

    def _evict_one(self) -> bool:
        """Free the least recently used snapshot's slot: never one this step saves into or
        restores from."""
        old = [key for key, snapshot in self.snapshots.items()
               if snapshot.saved and snapshot.last_used < self.step_started]
        if not old:
            return False
        key = min(old, key=lambda prefix: self.snapshots[prefix].last_used)
        self.free.append(self.snapshots.pop(key).slot)
        return True

    def reset(self) -> int:
        """Forget every snapshot; return how many there were."""
        count = 0
        while self._evict_one():
            count += 1
        return count


@dataclass
class StateStep:
    """The pool's part of one step: each row's slot, and the copies around the forward."""

    query_lens: list[int]  # new tokens of each row, padding rows included
    slots: torch.Tensor  # int64 [B]: each row's slot (padding rows: the dummy)
    copies_before: torch.Tensor  # int64 [n, 2]: (from, to) slots, before the forward
    copies_after: torch.Tensor  # int64 [m, 2]: (from, to), after: snapshots
    cache: StateCache | None = field(default=None, repr=False)  # set by the runner

    def layer_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One linear-attention layer's conv windows and recurrent states, every slot."""
        return self.cache.windows[layer], self.cache.recurrent[layer]


def lay_out_states(rows: Sequence, pad_to: int) -> StateStep:
    """The state pool's part of a step of `rows` (the scheduler's), padded to `pad_to`."""
    lengths = [len(row.token_ids) for row in rows] + [1] * (pad_to - len(rows))
    slots = [row.state_slot for row in rows] + [DUMMY_SLOT] * (pad_to - len(rows))
    before = [(row.state_source, row.state_slot) for row in rows if row.state_source is not None]
    after = [(row.state_slot, row.state_save) for row in rows if row.state_save is not None]
    return StateStep(lengths, torch.tensor(slots), _pairs(before), _pairs(after))


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


class StateCache:
    """The pool on the device: per linear-attention layer, `windows[layer]` `[slots, C, K-1]`
    and `recurrent[layer]` `[slots, heads, k_dim, v_dim]` (float32), allocated once."""

    def __init__(
        self, num_layers: int, num_slots: int, conv: tuple[int, ...], conv_dtype: torch.dtype,
        recurrent: tuple[int, ...], device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        total = FIRST_SLOT + num_slots
        self.windows = torch.zeros(num_layers, total, *conv, dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(num_layers, total, *recurrent, dtype=torch.float32,
                                     device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, conv: Sequence[int], conv_dtype: torch.dtype,
                       recurrent: Sequence[int]) -> int:
        return num_layers * (_count(conv) * conv_dtype.itemsize + _count(recurrent) * 4)

    @property
    def nbytes(self) -> int:
        return self.windows.nbytes + self.recurrent.nbytes

    def before(self, step: StateStep) -> StateStep:
        """The step's states ready for the layers: its slots on the device, each row's slot
        holding the state its tokens continue from."""
        step.cache, step.slots = self, step.slots.to(self.windows.device)
        self.copy(step.copies_before)
        return step

    def after(self, step: StateStep) -> None:
        """Save the snapshots the step asked for, now that its rows' states are computed."""
        self.copy(step.copies_after)

    def copy(self, pairs: torch.Tensor) -> None:
        """Copy every layer's state from slot `pairs[i, 0]` to slot `pairs[i, 1]`."""
        if pairs.numel():
            sources, targets = pairs[:, 0].to(self.windows.device), pairs[:, 1].to(self.windows.device)
            self.windows.index_copy_(1, targets, self.windows.index_select(1, sources))
            self.recurrent.index_copy_(1, targets, self.recurrent.index_select(1, sources))


def _count(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
