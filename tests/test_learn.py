"""The learning path (`docs/learn/`) stays true to the code it teaches.

Every note links files and names symbols (`nanoqwen.room.module.Symbol`); a rename that
forgets a note fails here. Every code block marked `python runnable` runs, on the tiny test
checkpoints, as part of the suite: twice, as a CPU without bf16 units runs it (float32 by
default) and as one with them does (bfloat16 by default), and CI runs them again on the
CPU's own kernels (`native_kernels`, tests/conftest.py). And the picture script
(`tools/learn_pictures.py`) runs on the same checkpoints: what it records of the engine is
checked against the engine's own invariants, and, where matplotlib is installed, drawn.
"""

from __future__ import annotations

import importlib
import re
import statistics
from pathlib import Path

import pytest
import torch

import nanoqwen.config
from tools import learn_pictures
from tools.bench_decode import STEP_PHASES

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "docs" / "learn"
NOTES = sorted(LEARN.glob("[0-9][0-9]-*.md"))
REFERENCE = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", LEARN / "README.md", *NOTES, *REFERENCE]
SECTIONS = (
    "The problem", "The idea", "The code", "How vLLM and SGLang do it", "Measured",
    "Questions", "References",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
SYMBOL = re.compile(r"(?:nanoqwen|tools)(?:\.\w+)+")
PATH = re.compile(r"(?:nanoqwen|tools|tests|docs)/[\w./-]*\.(?:py|md|png|html)")
RUNNABLE = re.compile(r"^```python runnable\n(.*?)^```", re.MULTILINE | re.DOTALL)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def runnable_blocks() -> list[tuple[str, str]]:
    return [
        (f"{note.stem}[{index}]", code)
        for note in NOTES
        for index, code in enumerate(RUNNABLE.findall(note.read_text()))
    ]


def resolve(dotted: str) -> object:
    """The module, class, function or attribute a dotted name names, or an AssertionError."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            assert hasattr(target, attribute), f"{dotted}: {attribute!r} not found"
            target = getattr(target, attribute)
        return target
    raise AssertionError(f"{dotted}: no such module")


def test_the_notes_are_numbered_from_00_without_gaps() -> None:
    assert [note.name[:2] for note in NOTES] == [f"{n:02}" for n in range(len(NOTES))]
    index = (LEARN / "README.md").read_text()
    for note in NOTES:
        assert f"]({note.name})" in index, f"the index does not link {note.name}"


# The roofline box of note 01, which the notes on speed lean on.
ROOFLINE = "01-forward-pass-and-kv-cache.md#box-the-roofline"
LEANS_ON_THE_ROOFLINE = ("10-cuda-graphs", "11-memory-and-load", "12-speculative-decoding",
                         "13-tensor-parallelism", "14-quantization")


@pytest.mark.parametrize("stem", LEANS_ON_THE_ROOFLINE)
def test_the_notes_on_speed_reuse_the_roofline_box(stem: str) -> None:
    assert f"]({ROOFLINE})" in (LEARN / f"{stem}.md").read_text()


@pytest.mark.parametrize("note", NOTES, ids=lambda p: p.stem)
def test_every_note_has_its_sections(note: Path) -> None:
    headings = re.findall(r"^## (.+)$", note.read_text(), re.MULTILINE)
    missing = [section for section in SECTIONS if section not in headings]
    assert not missing, f"{note.name} lacks {missing}"
    questions = note.read_text().split("## Questions")[1].split("## References")[0]
    assert 4 <= len(re.findall(r"^\d+\. \*\*", questions, re.MULTILINE)) <= 6
    assert "*Answer points:*" in questions and "*Follow-up:*" in questions


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a markdown page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_linked_files_exist(page: Path) -> None:
    text = page.read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    missing = []
    for target in targets:
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            missing.append(target)
    spans = [s for s in CODE_SPAN.findall(text) if PATH.fullmatch(s)]
    missing += [s for s in spans if not (ROOT / s).exists()]
    assert not missing, f"{rel(page)} links files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_symbols_exist(page: Path) -> None:
    names = {s for s in CODE_SPAN.findall(page.read_text()) if SYMBOL.fullmatch(s)}
    for name in sorted(names):
        resolve(name)


def test_the_readme_leads_to_the_learning_path_and_the_reference() -> None:
    """A newcomer sees the learning path on the first screen, and every docs/ page is linked."""
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:40])
    assert "](docs/learn/README.md)" in first_screen
    linked = set(LINK.findall(readme))
    orphans = [rel(page) for page in REFERENCE if rel(page) not in linked]
    assert not orphans, f"the README links no {orphans}"


def test_docstrings_point_to_pages_that_exist() -> None:
    """Module docstrings tell what a module is and point to the note with the story."""
    pointers = {
        (rel(path), target)
        for path in sorted((ROOT / "nanoqwen").rglob("*.py"))
        for target in re.findall(r"docs/[\w/-]+\.md", path.read_text())
    }
    assert len({target for _, target in pointers}) >= 10
    missing = [pointer for pointer in sorted(pointers) if not (ROOT / pointer[1]).exists()]
    assert not missing, f"docstrings point to pages that do not exist: {missing}"


def test_the_checkers_catch_a_rename() -> None:
    assert resolve("nanoqwen.memory.page_allocator.PageAllocator.allocate")
    with pytest.raises(AssertionError, match="'allocate_pages' not found"):
        resolve("nanoqwen.memory.page_allocator.PageAllocator.allocate_pages")
    with pytest.raises(AssertionError, match="no such module"):
        resolve("nanoqwen_gone.memory")
    assert PATH.fullmatch("nanoqwen/memory/kv_cache.py") and not PATH.fullmatch("kv_cache")
    assert {"running-the-examples", "the-figures"} <= anchors(LEARN / "README.md")
    assert "how-vllm-and-sglang-do-it" in anchors(NOTES[0]) and "how-it-works" not in anchors(NOTES[0])


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and much faster on a machine others share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.native_kernels
@pytest.mark.parametrize("cpu_has_bf16", [False, True], ids=["float32-cpu", "bf16-cpu"])
@pytest.mark.parametrize("name, code", runnable_blocks(), ids=[n for n, _ in runnable_blocks()])
def test_runnable_blocks_run(
    name: str, code: str, cpu_has_bf16: bool, qwen3_dir: str, one_thread: None,
    a_machine_without_a_gpu: None, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    """Each block as a reader's CPU runs it: with bf16 units, an engine left to its default
    computes in bfloat16. Blocks get `MODEL`; the notes on the newer kinds also `MOE_MODEL`
    or `HYBRID_MODEL`."""
    monkeypatch.setattr(nanoqwen.config, "cpu_has_native_bf16", lambda: cpu_has_bf16)
    names = {"MODEL": qwen3_dir, "__name__": name}
    for variable, kind in (("MOE_MODEL", "qwen3_moe"), ("HYBRID_MODEL", "qwen3_5")):
        if variable in code:
            names[variable] = request.getfixturevalue("picture_kind_dirs")[kind]
    exec(compile(code, name, "exec"), names)


def test_every_note_runs_something() -> None:
    with_blocks = {name.split("[")[0] for name, _ in runnable_blocks()}
    assert with_blocks == {note.stem for note in NOTES}


# --------------------------------------------------------------------------- the pictures
@pytest.fixture(scope="module")
def recorded(qwen3_dir: str) -> dict[str, object]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: collect(qwen3_dir) for name, (collect, _) in learn_pictures.PICTURES.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.native_kernels
def test_page_table_picture_shows_the_pool_as_it_is(recorded: dict[str, object]) -> None:
    snapshot = recorded["page_table.png"]
    size, refs = snapshot.page_size, snapshot.ref_counts
    assert len(snapshot.requests) == 3
    holders = [0] * len(refs)
    for _, computed, pages in snapshot.requests:
        assert len(pages) == -(-computed // size)  # exactly the pages its tokens fill
        for page in pages:
            holders[page] += 1
    assert all(refs[p] == holders[p] + snapshot.in_cache[p] for p in range(1, len(refs)))
    # What the caption says: the system prompt's 3 pages have 4 holders, and the finished
    # request left one page that only the prefix cache holds.
    assert [p for p in range(len(refs)) if refs[p] == 4] == [1, 2, 3]
    kinds = [learn_pictures.page_kind(snapshot, p) for p in range(1, len(refs))]
    assert kinds.count("cached") == 1 and "own" in kinds and "own+cache" in kinds
    csr = snapshot.csr
    assert csr["kv_indptr"][-1] == len(csr["kv_indices"]) and len(csr["kv_last_page_len"]) == 3
    assert max(b - a for a, b in zip(csr["qo_indptr"], csr["qo_indptr"][1:])) > 1  # a prefill


@pytest.mark.native_kernels
def test_radix_tree_picture_holds_every_cached_page(recorded: dict[str, object]) -> None:
    tree, num_pages = recorded["radix_tree.png"]
    nodes = list(learn_pictures._walk(tree))
    assert sum(node.num_pages for node in nodes) == num_pages
    assert len(tree.children) == 1  # the shared system prompt ...
    assert len(tree.children[0].children) == 2  # ... then the two chats part
    assert "helpful assistant" in tree.children[0].text


@pytest.mark.native_kernels
def test_timeline_picture_keeps_the_prefill_budget(recorded: dict[str, object]) -> None:
    timeline, chunk_size = recorded["chunked_prefill.png"]
    assert all(sum(n for _, n in step.prefills) <= chunk_size for step in timeline)
    mixed = [step for step in timeline if step.decodes and step.prefills]
    assert mixed, "no step mixed a prompt chunk with decodes"
    steps_of = {}
    for step in timeline:
        for rid, _ in step.prefills:
            steps_of[rid] = steps_of.get(rid, 0) + 1
    # What the caption says: the 150-token prompt takes five steps, the 90-token one three.
    assert (steps_of["req-4"], steps_of["req-5"]) == (5, 3)


@pytest.mark.native_kernels
def test_speculation_picture_shows_both_outcomes(recorded: dict[str, object]) -> None:
    verifications = recorded["speculation.png"]
    assert all(0 <= v.num_accepted <= v.num_proposed for v in verifications)
    guessed = [v for v in verifications if v.num_proposed]
    assert any(v.num_accepted == v.num_proposed for v in guessed)
    assert any(v.num_accepted < v.num_proposed for v in guessed)


@pytest.mark.native_kernels
def test_tensor_parallel_picture_covers_every_weight(recorded: dict[str, object]) -> None:
    ranks, shape = recorded["tensor_parallel.png"]
    head_dim = shape["head_dim"]

    def covered(slices: list[tuple[int, int]]) -> set[int]:
        return {i for start, length in slices for i in range(start, start + length)}

    q_rows = [(start, length) for r in ranks for name, start, length in r.qkv if name == "q"]
    length = q_rows[0][1]
    assert q_rows == [(rank * length, length) for rank in range(len(ranks))]  # disjoint, in order
    assert covered(q_rows) == set(range(shape["heads"] * head_dim))
    for block in "kv":
        kv_rows = [(s, n) for r in ranks for name, s, n in r.qkv if name == block]
        assert all(s % head_dim == 0 and n % head_dim == 0 for s, n in kv_rows)  # whole heads
        assert covered(kv_rows) == set(range(shape["kv_heads"] * head_dim))
    assert covered([r.o_proj_columns for r in ranks]) == set(range(shape["heads"] * head_dim))
    assert covered([r.down_columns for r in ranks]) == set(range(shape["intermediate"]))
    assert covered([r.vocab_rows for r in ranks]) >= set(range(shape["vocab"]))


@pytest.mark.native_kernels
def test_step_picture_shows_every_phase_in_order(recorded: dict[str, object]) -> None:
    steps = recorded["one_step.png"]
    order = {name: index for index, name in enumerate(STEP_PHASES)}
    for step in steps:
        names = [name for name, _, _ in step.phases]
        assert names == sorted(set(names), key=order.get)  # each phase once, in order
        assert {"schedule", "prepare", "forward", "sample", "postprocess"} <= set(names)
        assert "propose" not in names  # a plain engine has no step hooks
        done = 0.0
        for _, start, end in step.phases:
            assert done <= start <= end <= step.total
            done = end
    assert max(step.tokens for step in steps) == 64  # the chunk, full, in the first step
    assert min(step.tokens for step in steps) == 1


@pytest.mark.native_kernels
def test_load_picture_shows_the_queue_growing_past_capacity(recorded: dict[str, object]) -> None:
    points = recorded["load.png"]
    assert [point.rate for point in points] == list(learn_pictures.LOAD_RATES)
    for point in points:
        assert len(point.ttft) == learn_pictures.LOAD_REQUESTS and min(point.ttft) >= 1
        assert set(point.tpot) == {1.0}  # a running request gets a token every step
        throughput = len(point.ttft) / point.steps
        # Each request holds a seat for LOAD_OUTPUT steps: the seats bound the throughput.
        assert point.goodput <= throughput <= learn_pictures.LOAD_SEATS / learn_pictures.LOAD_OUTPUT
    waits = [statistics.median(point.ttft) for point in points]
    assert waits[0] == 1 and waits[-1] > learn_pictures.TTFT_SLO_STEPS


@pytest.mark.native_kernels
def test_pool_picture_accounts_for_every_page(recorded: dict[str, object]) -> None:
    history = recorded["kv_pool.png"]
    totals = {step.used + step.cached + step.free for step in history}
    assert len(totals) == 1
    assert history[-1].preemptions > 0 and history[-1].used == 0


def test_policies_picture_shows_one_seat_and_the_same_outputs(recorded: dict[str, object]) -> None:
    runs = {run.policy: run for run in recorded["policies.png"]}
    assert list(runs) == list(learn_pictures.POLICY_ORDER)
    for run in runs.values():
        assert run.outputs == runs["fcfs"].outputs  # no policy changes a token
        steps = [step for ran in run.ran for step in ran]
        assert len(steps) == len(set(steps))  # one seat: one request a step
        for request, ran, finished in zip(learn_pictures.POLICY_WORKLOAD, run.ran, run.finished):
            assert request[5] <= ran[0] and ran[-1] == finished

    def order(policy: str) -> list[int]:
        return sorted(range(len(learn_pictures.POLICY_WORKLOAD)),
                      key=lambda i: runs[policy].finished[i])
    assert order("fcfs") == list(range(7))
    assert order("sjf")[:3] == [4, 5, 6] and order("deadline")[:2] == [5, 6]
    assert order("fair")[:3] == [0, 4, 6]  # each user's first, then the seconds


def test_picture_script_draws_every_picture(recorded: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for name, (_, draw) in learn_pictures.PICTURES.items():
        draw(recorded[name], tmp_path / name)
    for name in learn_pictures.PICTURES:
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_notes_show_the_committed_pictures() -> None:
    shown = {name for note in NOTES for name in re.findall(r"\(img/([\w.]+)\)", note.read_text())}
    assert shown == {*learn_pictures.PICTURES, *learn_pictures.KIND_PICTURES}
    assert all((LEARN / "img" / name).exists() for name in shown)
