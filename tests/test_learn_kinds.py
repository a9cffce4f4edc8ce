"""The pictures of the learning path's notes on the newer kinds (mixture of experts, hybrid
attention) tell the truth: what `tools/learn_pictures.py` records of the running engine is
checked against the engine's own invariants and against what the captions say. The notes
themselves (links, symbols, runnable blocks) are checked with the others, in test_learn.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools import learn_pictures


@pytest.fixture(scope="module")
def recorded(picture_kind_dirs: dict[str, str]) -> dict[str, object]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: collect(picture_kind_dirs[kind])
                for name, (kind, collect, _) in learn_pictures.KIND_PICTURES.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.native_kernels
def test_expert_load_picture_counts_every_routing_decision(recorded: dict[str, object]) -> None:
    load = recorded["expert_load.png"]
    assert len(load.per_layer) == 4  # every layer of the pictures' model is sparse
    # Each token went through every sparse layer to k distinct experts: none lost or added.
    assert all(sum(counts) == load.top_k * load.tokens for counts in load.per_layer)
    assert load.decode_steps and all(
        load.top_k <= ran <= min(load.num_experts, load.top_k * size)
        for size, layers in load.decode_steps for ran in layers
    )
    # What the caption says: a batch of 16 decodes runs most of the 32 experts, never all.
    assert max(size for size, _ in load.decode_steps) == 16
    assert all(ran < load.num_experts for _, layers in load.decode_steps for ran in layers)


@pytest.mark.native_kernels
def test_pools_picture_accounts_for_every_slot(recorded: dict[str, object]) -> None:
    history = recorded["hybrid_pools.png"]
    assert len({sum(step.pages) for step in history}) == 1
    assert len({sum(step.slots) for step in history}) == 1
    assert all(step.slots[0] == step.running for step in history)  # one slot a request
    assert max(step.slots[1] for step in history) > 0
    restored = [cached for step in history for cached in step.restored]
    # What the caption says: of twenty requests all but the first start from the cache, at
    # least from the end of the system prompt (48 tokens), and the ten second turns from
    # further on, inside their first turn.
    assert len(restored) == 20 and restored[0] == 0
    assert all(cached >= 48 and cached % 8 == 0 for cached in restored[1:])
    assert sum(cached > 48 for cached in restored) == 10


def test_kind_pictures_draw(recorded: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for name, (_, _, draw) in learn_pictures.KIND_PICTURES.items():
        draw(recorded[name], tmp_path / name)
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
