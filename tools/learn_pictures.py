"""The learning path's pictures (`docs/learn/img/`), drawn from the engine as it runs.

Every picture runs the real engine on a tiny random checkpoint (`tools/checkpoints.py`),
records what it did as plain data (a `collect_*` function, which the tests check against
the engine's own invariants) and draws that with matplotlib (a `draw_*` function). Nothing
is drawn by hand, so a picture changes when the code does:

    python -m tools.learn_pictures                  # from the repository root: docs/learn/img/
    python -m tools.learn_pictures --out /tmp/pics  # anywhere else

Without `--model` it builds the tiny Qwen3 checkpoint the tests use (seeded, and run in
float32 on one CPU thread, on a GPU machine too: the same pictures every run, whatever the
CPU; the step timings of `one_step.png` excepted, which are this machine's CPU's); the
pictures of the mixture-of-experts and hybrid models are drawn from tiny checkpoints of
those kinds (`KIND_PICTURES`).
matplotlib is an optional extra: `pip install -e ".[plot]"`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoqwen import LLMEngine, SamplingParams
from nanoqwen.model.layers import TensorParallel, split_across
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.runner import StepInputs
from nanoqwen.scheduling.scheduler import Row
from nanoqwen.weights.checkpoint import open_checkpoint
from tools.bench_decode import STEP_PHASES, observe

IMAGE_DIR = Path(__file__).resolve().parents[1] / "docs" / "learn" / "img"
GREEDY = dict(temperature=0.0, ignore_eos=True)
ON_THE_CPU = {"device": "cpu", "dtype": "float32"}  # every engine here: the same pictures anywhere


class StepRecorder:
    """A step observer (`tools.bench_decode.observe`) that keeps every step's rows as they
    were laid out: `(request id, new tokens, tokens computed before, prompt length,
    appended guesses)`."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int, int, list[int]]]] = []
        self.inputs: list[StepInputs] = []

    def phase(self, name: str) -> Any:
        return nullcontext()

    def laid_out(self, rows: list[Row], inputs: StepInputs) -> None:
        self.steps.append([
            (row.request.request_id, len(row.token_ids), row.start,
             row.request.num_prompt_tokens, row.token_ids[len(row.token_ids) - row.num_sampled + 1 :])
            for row in rows
        ])
        self.inputs.append(inputs)


# --------------------------------------------------------------------------- 1. page table
@dataclass
class PageTableSnapshot:
    """The engine between two steps: each running request's page table, and every page's
    holders (`ref_counts`; `in_cache`: the prefix cache is one of them)."""

    page_size: int
    requests: list[tuple[str, int, list[int]]]  # (id, tokens with K/V, pages)
    ref_counts: list[int]
    in_cache: list[bool]
    csr: dict[str, list[int]]  # the page table of the step just run, as the kernels read it


def collect_page_table(model: str) -> PageTableSnapshot:
    """Three requests sharing a system prompt, one of them decoding, one mid-prefill, after
    an earlier request has finished and left its pages to the prefix cache."""
    engine = LLMEngine(model, page_size=4, num_pages=40, chunk_size=12, max_num_seqs=4,
                       **ON_THE_CPU)
    recorder = StepRecorder()
    observe(engine, recorder)
    system = list(range(10, 22))  # 12 tokens: three whole pages, shared by everyone
    engine.add_request(system + [300, 301, 302, 303, 304], SamplingParams(max_tokens=3, **GREEDY))
    _run_until_idle(engine)  # finished: its full pages stay in the prefix cache
    for offset, length, max_tokens in ((400, 3, 20), (500, 7, 20), (600, 22, 20)):
        prompt = system + list(range(offset, offset + length))
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    for _ in range(3):
        engine.step()
    allocator = engine.allocator
    inputs = recorder.inputs[-1].metadata
    csr = {
        name: getattr(inputs, name).tolist()
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")
    }
    return PageTableSnapshot(
        page_size=allocator.page_size,
        requests=[(r.request_id, r.num_computed_tokens, list(r.pages)) for r in engine.scheduler.running],
        ref_counts=list(allocator.ref_counts),
        in_cache=list(allocator.in_cache),
        csr=csr,
    )


PAGE_COLORS = {
    "several": ("#f4a259", "several requests'"),
    "own+cache": ("#9bc59d", "one request's, in the prefix cache too"),
    "own": ("#4f7f6f", "one request's alone"),
    "cached": ("#8cb4d8", "the prefix cache's alone (evictable)"),
    "free": ("#eeeeee", "free"),
}


def page_kind(snapshot: PageTableSnapshot, page: int) -> str:
    """Who holds `page`: the key of `PAGE_COLORS`."""
    cached = snapshot.in_cache[page]
    requests = snapshot.ref_counts[page] - cached  # holders other than the prefix cache
    if requests == 0:
        return "cached" if cached else "free"
    if requests > 1:
        return "several"
    return "own+cache" if cached else "own"


def draw_page_table(snapshot: PageTableSnapshot, path: Path) -> None:
    plt, patches = _pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 6.2), gridspec_kw={"height_ratios": [len(snapshot.requests) + 1, 2.2]}
    )
    size = snapshot.page_size
    for row, (request_id, computed, pages) in enumerate(snapshot.requests):
        y = len(snapshot.requests) - row
        top.text(-0.3, y, f"{request_id}\n{computed} tokens", ha="right", va="center", fontsize=9)
        for index, page in enumerate(pages):
            color = PAGE_COLORS[page_kind(snapshot, page)][0]
            filled = min(size, max(0, computed - index * size))
            for slot in range(size):
                face = color if slot < filled else "white"
                top.add_patch(patches.Rectangle((index + slot / size, y - 0.35), 1 / size, 0.7,
                                                facecolor=face, edgecolor="#999999", lw=0.4))
            top.add_patch(patches.Rectangle((index, y - 0.35), 1, 0.7, fill=False, lw=1.2))
            top.text(index + 0.5, y + 0.45, f"page {page}", ha="center", fontsize=7)
    width = max(len(pages) for _, _, pages in snapshot.requests)
    top.set_xlim(-2.2, width + 0.2)
    top.set_ylim(0.3, len(snapshot.requests) + 1)
    top.set_title(f"Each running request's page table (page_size {size}); a slot is shaded "
                  "once its token's K/V is in it", fontsize=10)
    top.axis("off")
    for page in range(1, len(snapshot.ref_counts)):
        color = PAGE_COLORS[page_kind(snapshot, page)][0]
        bottom.add_patch(patches.Rectangle((page - 1, 0), 0.92, 1, facecolor=color))
        bottom.text(page - 0.54, 0.5, str(page), ha="center", va="center", fontsize=7)
        if snapshot.ref_counts[page]:
            bottom.text(page - 0.54, -0.35, f"×{snapshot.ref_counts[page]}", ha="center", fontsize=6)
    csr = snapshot.csr
    bottom.text(0, -1.3, "\n".join(f"{name} = {values}" for name, values in csr.items()),
                fontsize=8, family="monospace", va="top")
    bottom.set_xlim(-0.2, len(snapshot.ref_counts))
    bottom.set_ylim(-3.4, 1.4)
    bottom.set_title("The pool (page 0, scratch, not shown): ×n = holders, the prefix cache "
                     "counted; below, the page table of the step just run, as kernels read it",
                     fontsize=10)
    bottom.axis("off")
    bottom.legend(handles=[patches.Patch(color=c, label=label) for c, label in PAGE_COLORS.values()],
                  loc="upper right", fontsize=8, ncol=3, bbox_to_anchor=(1, 1.75))
    _save(fig, path)


# --------------------------------------------------------------------------- 2. radix tree
@dataclass
class TreeNode:
    text: str  # the edge's tokens, decoded
    num_pages: int
    children: list[TreeNode] = field(default_factory=list)


def collect_radix_tree(model: str) -> tuple[TreeNode, int]:
    """The prefix cache after a three-turn chat and a second chat with the same system
    prompt; returns the tree and the number of pages the cache holds."""
    engine = LLMEngine(model, page_size=8, num_pages=128, **ON_THE_CPU)
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=12, **GREEDY)
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly."}
    chat = [system]
    for question in ("What is a page table?", "Why pages of 16 tokens?", "And the radix tree?"):
        chat.append({"role": "user", "content": question})
        engine.add_request(tokenizer.apply_chat_template(chat), params)
        reply = _run_until_idle(engine)[0]
        chat.append({"role": "assistant", "content": reply.text})
    other = [system, {"role": "user", "content": "Hello there!"}]
    engine.add_request(tokenizer.apply_chat_template(other), params)
    _run_until_idle(engine)

    def convert(node: Any) -> TreeNode:
        children = [convert(child) for child in node.children.values()]
        return TreeNode(tokenizer.decode(node.tokens), len(node.pages), children)

    return convert(engine.cache.root), engine.cache.num_pages


def draw_radix_tree(tree: TreeNode, path: Path) -> None:
    plt, patches = _pyplot()
    fig, axes = plt.subplots(figsize=(12, 6))
    positions: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node: TreeNode, depth: int) -> float:
        if node.children:
            x = sum(place(child, depth + 1) for child in node.children) / len(node.children)
        else:
            x, next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        positions[id(node)] = (x, -depth)
        return x

    place(tree, 0)
    for node in _walk(tree):
        x, y = positions[id(node)]
        for child in node.children:
            cx, cy = positions[id(child)]
            axes.plot([x, cx], [y - 0.12, cy + 0.12], color="#888888", lw=1)
        pages = f"{node.num_pages} page" + "s" * (node.num_pages != 1)
        label = "root" if node is tree else f"{pages}\n{_shorten(node.text, 60)}"
        axes.text(x, y, label, ha="center", va="center", fontsize=7.5,
                  bbox=dict(boxstyle="round", facecolor="#dde8f0" if node.children else "#f6e3c5",
                            edgecolor="#777777"))
    xs = [x for x, _ in positions.values()]
    ys = [y for _, y in positions.values()]
    axes.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    axes.set_ylim(min(ys) - 0.6, 0.5)
    axes.set_title("The prefix cache after a three-turn chat (left) and a second chat with the "
                   "same system prompt (right);\neach box is an edge of whole pages and its text "
                   "(the replies are a random model's)", fontsize=10)
    axes.axis("off")
    _save(fig, path)


# --------------------------------------------------------------------------- 3. chunked prefill
@dataclass
class TimelineStep:
    decodes: list[str]  # requests decoding one token this step
    prefills: list[tuple[str, int]]  # (request, prompt tokens computed this step)


def collect_timeline(model: str, chunk_size: int = 32) -> tuple[list[TimelineStep], int]:
    """Four requests decode while two long prompts arrive (at steps 4 and 9): each step
    carries every decode plus at most `chunk_size` prompt tokens."""
    engine = LLMEngine(model, page_size=8, num_pages=128, chunk_size=chunk_size, **ON_THE_CPU)
    recorder = StepRecorder()
    observe(engine, recorder)
    arrivals = {0: [12, 14, 10, 16], 4: [150], 9: [90]}
    token = iter(range(50, 10_000))
    step = 0
    while step in arrivals or engine.has_unfinished_requests():
        for length in arrivals.get(step, []):
            prompt = [next(token) % 700 + 50 for _ in range(length)]
            engine.add_request(prompt, SamplingParams(max_tokens=14, **GREEDY))
        engine.step()
        step += 1
    timeline = []
    for batch in recorder.steps:
        decodes = [rid for rid, n, done, prompt_len, _ in batch if n == 1 and done >= prompt_len]
        prefills = [(rid, n) for rid, n, done, prompt_len, _ in batch if not (n == 1 and done >= prompt_len)]
        timeline.append(TimelineStep(decodes, prefills))
    return timeline, chunk_size


def draw_timeline(timeline: list[TimelineStep], chunk_size: int, path: Path) -> None:
    plt, patches = _pyplot()
    fig, axes = plt.subplots(figsize=(11, 4.5))
    names = sorted({rid for s in timeline for rid in s.decodes + [r for r, _ in s.prefills]},
                   key=lambda rid: int(rid.split("-")[1]))
    palette = plt.get_cmap("tab10")
    color = {rid: palette(i % 10) for i, rid in enumerate(names)}
    for x, step in enumerate(timeline):
        bottom = 0
        for rid in step.decodes:
            axes.bar(x, 1, bottom=bottom, color=color[rid], edgecolor="black", lw=0.3, width=0.8)
            bottom += 1
        for rid, count in step.prefills:
            axes.bar(x, count, bottom=bottom, color=color[rid], edgecolor="black", lw=0.3,
                     width=0.8, hatch="//")
            bottom += count
    axes.axhline(chunk_size, color="#aa3333", ls="--", lw=1)
    axes.text(len(timeline) - 0.5, chunk_size - 2.5, f"chunk_size = {chunk_size} prompt tokens",
              ha="right", color="#aa3333", fontsize=8)
    axes.set_xlabel("engine step")
    axes.set_ylabel("tokens computed in the step")
    axes.set_title("Chunked prefill: hatched = prompt chunks, plain = one decode token;\ndecodes "
                   "ride along every step and spend none of the budget", fontsize=10)
    axes.legend(handles=[patches.Patch(color=color[r], label=r) for r in names], fontsize=7,
                ncol=len(names), loc="upper right")
    _save(fig, path)


# --------------------------------------------------------------------------- 4. speculation
@dataclass
class Verification:
    step: int
    request_id: str
    num_proposed: int
    num_accepted: int


def collect_speculation(model: str) -> list[Verification]:
    """Prompt-lookup speculation (4 guesses a step) on prompts that repeat themselves: every
    step of every request that got tokens, with what was guessed and what was kept."""
    engine = LLMEngine(model, speculative="ngram", num_speculative_tokens=4, page_size=8,
                       num_pages=128, **ON_THE_CPU)
    recorder = StepRecorder()
    observe(engine, recorder)
    phrase = list(range(120, 132))
    for prompt in (phrase * 3, [60, 61] + phrase * 2 + [62, 63, 64], list(range(200, 224))):
        engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY))
    verifications = []
    while engine.has_unfinished_requests():
        outputs = {o.request_id: o for o in engine.step()}
        for rid, _, _, _, proposed in recorder.steps[-1]:
            if rid in outputs and outputs[rid].delta_token_ids:
                accepted = len(outputs[rid].delta_token_ids) - 1
                verifications.append(Verification(len(recorder.steps) - 1, rid, len(proposed), accepted))
    return verifications


def draw_speculation(verifications: list[Verification], path: Path) -> None:
    plt, patches = _pyplot()
    names = sorted({v.request_id for v in verifications})
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.6 * len(names) + 0.8), squeeze=False)
    for ax, rid in zip(axes[:, 0], names):
        for v in (v for v in verifications if v.request_id == rid):
            for slot in range(v.num_proposed):
                ok = slot < v.num_accepted
                ax.add_patch(patches.Rectangle((v.step, slot), 0.85, 0.85,
                                               facecolor="#5b9e5b" if ok else "#d0605e"))
            ax.add_patch(patches.Rectangle((v.step + 0.05, v.num_accepted + 0.08), 0.75, 0.69,
                                           fill=False, edgecolor="#3060a0", lw=1.5))
        last = max(v.step for v in verifications)
        ax.set_xlim(-0.5, last + 1.5)
        ax.set_xticks(range(0, last + 1, 2))
        ax.set_ylim(-0.2, 5)
        ax.set_ylabel(rid, fontsize=8)
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("engine step")
    axes[0, 0].set_title("Each request's tokens per step: green guesses accepted, red rejected;\n"
                         "blue outline, the target's own token (after the accepted ones)",
                         fontsize=10)
    _save(fig, path)


# --------------------------------------------------------------------------- 5. tensor parallelism
@dataclass
class RankSlices:
    """Which rows (column-parallel) or columns (row-parallel) of each weight a rank keeps."""

    rank: int
    qkv: list[tuple[str, int, int]]  # (block: q, k or v; first row; rows)
    o_proj_columns: tuple[int, int]
    gate_up: list[tuple[str, int, int]]
    down_columns: tuple[int, int]
    vocab_rows: tuple[int, int]


def collect_tensor_parallel(model: str, size: int = 4) -> tuple[list[RankSlices], dict[str, int]]:
    """Build every rank's decoder layer (on the meta device: shapes, no memory) and read
    which part of each checkpoint weight it keeps."""
    config = open_checkpoint(model).model_config
    ranks = []
    for rank in range(size):
        with split_across(TensorParallel(rank, size)), torch.device("meta"):
            built = QwenForCausalLM(config)
        layer = built.model.layers[0]
        attention, mlp = layer.self_attn, layer.mlp
        ranks.append(RankSlices(
            rank,
            [(name, s.start, s.length) for name, s in zip("qkv", attention.qkv_proj.splits)],
            (attention.o_proj.in_split.start, attention.o_proj.in_split.length),
            [(name, s.start, s.length) for name, s in zip(("gate", "up"), mlp.gate_up_proj.splits)],
            (mlp.down_proj.in_split.start, mlp.down_proj.in_split.length),
            (built.model.embed_tokens.first_id, built.model.embed_tokens.weight.shape[0]),
        ))
    shape = dict(heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                 hidden=config.hidden_size, intermediate=config.intermediate_size,
                 vocab=config.vocab_size)
    return ranks, shape


def draw_tensor_parallel(ranks: list[RankSlices], shape: dict[str, int], path: Path) -> None:
    plt, patches = _pyplot()
    fig, axes = plt.subplots(figsize=(11, 5.2))
    palette = plt.get_cmap("Set2")
    head_dim, size = shape["head_dim"], len(ranks)
    blocks = {"q": shape["heads"] * head_dim, "k": shape["kv_heads"] * head_dim,
              "v": shape["kv_heads"] * head_dim}
    rows = [
        ("qkv_proj rows (column-parallel)", [(b, blocks[b]) for b in "qkv"],
         lambda r: r.qkv),
        ("o_proj columns (row-parallel), then all-reduce ①",
         [("one column per query head channel", blocks["q"])],
         lambda r: [("one column per query head channel", *r.o_proj_columns)]),
        ("gate_up_proj rows (column-parallel)",
         [("gate", shape["intermediate"]), ("up", shape["intermediate"])],
         lambda r: r.gate_up),
        ("down_proj columns (row-parallel), then all-reduce ②",
         [("one column per MLP channel", shape["intermediate"])],
         lambda r: [("one column per MLP channel", *r.down_columns)]),
        ("embed_tokens / lm_head rows", [("one row per token id", shape["vocab"])],
         lambda r: [("one row per token id", *r.vocab_rows)]),
    ]
    for row, (title, layout, slices_of) in enumerate(rows):
        y = len(rows) - row
        total = sum(length for _, length in layout)
        offsets, start = {}, 0.0
        for name, length in layout:
            offsets[name] = start
            axes.add_patch(patches.Rectangle((start / total, y), length / total, 0.55, fill=False))
            axes.text((start + length / 2) / total, y + 0.62, name, ha="center", fontsize=7)
            if name in blocks:  # head boundaries
                for head in range(1, length // head_dim):
                    x = (start + head * head_dim) / total
                    axes.plot([x, x], [y, y + 0.55], color="#bbbbbb", lw=0.6, ls=":")
            start += length
        for r in ranks:
            lane = 0.55 / size
            for name, first, length in slices_of(r):
                length = min(length, dict(layout)[name] - first)  # vocabulary padding
                x = (offsets[name] + first) / total
                axes.add_patch(patches.Rectangle((x, y + r.rank * lane), length / total, lane,
                                                 facecolor=palette(r.rank), edgecolor="none"))
        axes.text(-0.02, y + 0.27, title, ha="right", va="center", fontsize=8)
    axes.legend(handles=[patches.Patch(color=palette(r), label=f"rank {r}") for r in range(size)],
                loc="lower right", fontsize=8, ncol=size, bbox_to_anchor=(1, -0.05))
    axes.set_xlim(-0.55, 1.02)
    axes.set_ylim(0.6, len(rows) + 0.9)
    axes.set_title(
        f"One decoder layer on {size} ranks ({shape['heads']} query heads, {shape['kv_heads']} "
        f"KV heads of {head_dim}; dotted: head boundaries):\neach lane is what one rank keeps. "
        "With fewer KV heads than ranks, each is kept by several", fontsize=10)
    axes.axis("off")
    _save(fig, path)


# --------------------------------------------------------------------------- 6. pool over time
@dataclass
class PoolStep:
    used: int
    cached: int
    free: int
    preemptions: int  # so far


def collect_pool(model: str) -> list[PoolStep]:
    """Twelve requests with a shared prefix in a pool too small for all of them at once:
    pages fill, cached pages are evicted, and requests are preempted and recomputed."""
    engine = LLMEngine(model, page_size=8, num_pages=48, chunk_size=64, max_num_seqs=12,
                       **ON_THE_CPU)
    shared = list(range(30, 62))
    for i in range(12):
        prompt = shared + [100 + 7 * i + j for j in range(8 + 6 * (i % 3))]
        engine.add_request(prompt, SamplingParams(max_tokens=30 + 5 * (i % 4), **GREEDY))
    history = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        pages = stats["kv_cache"]
        history.append(PoolStep(pages["pages_used"], pages["pages_cached"], pages["pages_free"],
                                stats["requests"]["preemptions"]))
    return history


def draw_pool(history: list[PoolStep], path: Path) -> None:
    plt, _ = _pyplot()
    fig, axes = plt.subplots(figsize=(11, 3.8))
    steps = range(len(history))
    axes.stackplot(steps, [h.used for h in history], [h.cached for h in history],
                   [h.free for h in history], labels=["in use", "cached (evictable)", "free"],
                   colors=["#5b8e7d", "#8cb4d8", "#eeeeee"])
    for step in range(1, len(history)):
        if history[step].preemptions > history[step - 1].preemptions:
            axes.axvline(step, color="#aa3333", lw=0.8, ls=":")
    axes.set_xlabel("engine step")
    axes.set_ylabel("pages")
    axes.set_xlim(0, len(history) - 1)
    axes.set_title("The KV pool during a workload larger than it;\ndotted lines mark "
                   "preemptions (a request's pages released, its work recomputed later)",
                   fontsize=10)
    axes.legend(loc="upper right", fontsize=8)
    _save(fig, path)


# --------------------------------------------------------------------------- 7. one step
@dataclass
class StepTiming:
    """One `engine.step()`: its rows and new tokens, and when each phase of it ran, in
    seconds from the step's start (`STEP_PHASES`, as `tools.bench_decode.observe` names
    them; "postprocess" twice: the scheduler's `advance`, then appending the tokens)."""

    rows: int
    tokens: int
    phases: list[tuple[str, float, float]]
    total: float


class PhaseClock:
    """A step observer that keeps when every phase of the current step began and ended."""

    def __init__(self) -> None:
        self.start = 0.0
        self.phases: list[tuple[str, float, float]] = []
        self.rows = self.tokens = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begun = time.perf_counter() - self.start
        try:
            yield
        finally:
            if self.phases and self.phases[-1][0] == name:  # appending, request by request
                begun = self.phases.pop()[1]
            self.phases.append((name, begun, time.perf_counter() - self.start))

    def laid_out(self, rows: list[Row], inputs: StepInputs) -> None:
        self.rows, self.tokens = len(rows), sum(len(row.token_ids) for row in rows)


def collect_one_step(model: str) -> list[StepTiming]:
    """Three prompts, then a fourth arriving mid-flight: every step's phases on the clock."""
    engine = LLMEngine(model, page_size=8, num_pages=128, chunk_size=64, **ON_THE_CPU)
    clock = PhaseClock()
    observe(engine, clock)
    arrivals = {0: [40, 24, 8], 3: [56]}
    steps: list[StepTiming] = []
    while len(steps) in arrivals or engine.has_unfinished_requests():
        for length in arrivals.get(len(steps), []):
            prompt = [50 + (7 * i + length) % 600 for i in range(length)]
            engine.add_request(prompt, SamplingParams(max_tokens=5, **GREEDY))
        clock.phases, clock.start = [], time.perf_counter()
        engine.step()
        total = time.perf_counter() - clock.start
        steps.append(StepTiming(clock.rows, clock.tokens, clock.phases, total))
    return steps


PHASE_COLORS = {
    "schedule": "#8cb4d8", "propose": "#c9a0dc", "prepare": "#f4a259", "forward": "#5b8e7d",
    "sample": "#d0605e", "postprocess": "#bbbbbb",
}
PHASE_LABELS = {
    "schedule": "schedule", "propose": "step hooks: before layout", "prepare": "lay out",
    "forward": "forward", "sample": "choose tokens", "postprocess": "advance, append tokens",
}


def draw_one_step(steps: list[StepTiming], path: Path) -> None:
    plt, patches = _pyplot()
    fig, axes = plt.subplots(figsize=(11, 0.42 * len(steps) + 1.6))
    for y, step in enumerate(steps):
        for name, start, end in step.phases:
            axes.barh(y, (end - start) * 1000, left=start * 1000, color=PHASE_COLORS[name],
                      edgecolor="black", lw=0.3, height=0.7)
            if name == "sample":  # the sampled ids' copy: where a GPU makes the host wait
                axes.plot(end * 1000, y, marker="v", color="black", markersize=6)
        rows = f"{step.rows} row{'s' * (step.rows != 1)}, {step.tokens} token{'s' * (step.tokens != 1)}"
        axes.text(step.total * 1000 + 0.05, y, rows, va="center", fontsize=7)
    axes.invert_yaxis()
    axes.set_yticks(range(len(steps)), [f"step {i}" for i in range(len(steps))], fontsize=7)
    axes.set_xlabel("milliseconds from the start of engine.step() (tiny model, CPU, one thread)")
    axes.set_xlim(0, max(step.total for step in steps) * 1000 * 1.25)
    used = [name for name in STEP_PHASES if any(p[0] == name for s in steps for p in s.phases)]
    handles = [patches.Patch(color=PHASE_COLORS[n], label=PHASE_LABELS[n]) for n in used]
    handles.append(axes.plot([], [], "v", color="black", label="host waits for the device")[0])
    axes.legend(handles=handles, fontsize=7, loc="lower right")
    axes.set_title("One engine step after another: schedule → lay out → forward → choose tokens "
                   "→ advance, append;\nthe one synchronisation is the copy of the chosen ids "
                   "(▼)", fontsize=10)
    _save(fig, path)


# --------------------------------------------------------------------------- 8. load
# Requests per step arriving as a Poisson process, and the engine that serves them: 4 seats,
# each request holding one for about LOAD_OUTPUT steps, so about 0.38 requests per step fit.
LOAD_RATES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
LOAD_REQUESTS, LOAD_PROMPT, LOAD_OUTPUT, LOAD_SEATS = 40, 16, 10, 4
TTFT_SLO_STEPS = 10  # what "good" means for goodput: a first token within 10 steps


@dataclass
class LoadPoint:
    """One arrival rate: each request's time to first token (steps from its arrival to the
    step that gave its first token) and steps per later token, and how many steps it all
    took."""

    rate: float
    ttft: list[int]
    tpot: list[float]
    steps: int

    @property
    def goodput(self) -> float:
        """Requests per step whose first token came within `TTFT_SLO_STEPS`."""
        return sum(t <= TTFT_SLO_STEPS for t in self.ttft) / self.steps


def collect_load(model: str) -> list[LoadPoint]:
    """The same requests at rising arrival rates; latency counted in engine steps."""
    return [_serve_at(model, rate) for rate in LOAD_RATES]


def _serve_at(model: str, rate: float) -> LoadPoint:
    rng = random.Random(0)
    arrival, arrivals = 0.0, []
    for _ in range(LOAD_REQUESTS):
        arrival += rng.expovariate(rate)  # Poisson: exponential gaps between arrivals
        arrivals.append(int(arrival))
    engine = LLMEngine(model, page_size=8, num_pages=256, chunk_size=64, max_num_seqs=LOAD_SEATS,
                       **ON_THE_CPU)
    params = SamplingParams(max_tokens=LOAD_OUTPUT, **GREEDY)
    arrived, first, last = {}, {}, {}
    step = 0
    while len(arrived) < len(arrivals) or engine.has_unfinished_requests():
        while len(arrived) < len(arrivals) and arrivals[len(arrived)] <= step:
            prompt = [rng.randrange(50, 750) for _ in range(LOAD_PROMPT)]
            arrived[engine.add_request(prompt, params)] = step
        step += 1
        for output in engine.step():
            if output.delta_token_ids:
                first.setdefault(output.request_id, step)
                last[output.request_id] = step
    ttft = [first[rid] - arrived[rid] for rid in arrived]
    tpot = [(last[rid] - first[rid]) / (LOAD_OUTPUT - 1) for rid in arrived]
    return LoadPoint(rate, ttft, tpot, step)


def draw_load(points: list[LoadPoint], path: Path) -> None:
    plt, _ = _pyplot()
    fig, (latency, served) = plt.subplots(1, 2, figsize=(11, 3.8))
    rates = [p.rate for p in points]
    for q, style in ((50, "-o"), (95, "--o")):
        latency.plot(rates, [statistics.quantiles(p.ttft, n=100)[q - 1] for p in points], style,
                     color="#d0605e", label=f"time to first token, P{q}")
    latency.plot(rates, [statistics.median(p.tpot) for p in points], "-s", color="#5b8e7d",
                 label="steps per later token, P50")
    latency.axhline(TTFT_SLO_STEPS, color="#999999", ls=":", lw=1)
    latency.set_xlabel("arrival rate (requests per step, Poisson)")
    latency.set_ylabel("engine steps")
    latency.set_yscale("log")
    latency.legend(fontsize=8)
    served.plot(rates, rates, ":", color="#999999", label="offered load")
    served.plot(rates, [len(p.ttft) / p.steps for p in points], "-o", color="#3060a0",
                label="throughput: requests finished per step")
    served.plot(rates, [p.goodput for p in points], "-o", color="#f4a259",
                label=f"goodput: of them, first token within {TTFT_SLO_STEPS} steps")
    served.set_xlabel("arrival rate (requests per step, Poisson)")
    served.set_ylabel("requests per step")
    served.legend(fontsize=8)
    fig.suptitle(f"{LOAD_SEATS} seats, {LOAD_REQUESTS} requests of {LOAD_PROMPT} + {LOAD_OUTPUT} "
                 "tokens: past the rate the seats can serve, waits grow without bound",
                 fontsize=10)
    _save(fig, path)


# --------------------------------------------------------------------------- 9. policies
# One seat; a user's batch of four long jobs at step 0, then two short chats of another
# user at step 4 and one of a third at step 8: (user, prompt tokens, output tokens,
# priority, deadline in seconds or None, arrival step).
POLICY_WORKLOAD = [
    ("alice", 48, 8, 1, None, 0), ("alice", 40, 8, 1, None, 0),
    ("alice", 56, 8, 1, None, 0), ("alice", 32, 8, 1, None, 0),
    ("bob", 6, 4, 0, 20, 4), ("bob", 12, 4, 0, 10, 4), ("carol", 24, 4, 0, 5, 8),
]
POLICY_ORDER = ("fcfs", "priority", "deadline", "sjf", "fair")


@dataclass
class PolicyRun:
    policy: str
    ran: list[list[int]]  # per request of POLICY_WORKLOAD, the steps it computed in
    finished: list[int]  # the step it finished in
    outputs: list[list[int]]
    preemptions: int


def collect_policies(model: str) -> list[PolicyRun]:
    """The same arrivals under every policy, one seat: who runs in which step."""
    runs = []
    for policy in POLICY_ORDER:
        engine = LLMEngine(model, max_num_seqs=1, page_size=8, num_pages=128,
                           scheduling_policy=policy, **ON_THE_CPU)
        recorder = StepRecorder()
        observe(engine, recorder)
        token = iter(range(50, 10_000))
        ids: list[str] = []
        finished: dict[str, int] = {}
        outputs: dict[str, list[int]] = {}
        step = 0
        while len(ids) < len(POLICY_WORKLOAD) or engine.has_unfinished_requests():
            for user, length, out, priority, deadline, arrival in POLICY_WORKLOAD:
                if arrival == step:
                    prompt = [next(token) % 700 + 50 for _ in range(length)]
                    ids.append(engine.add_request(
                        prompt, SamplingParams(max_tokens=out, **GREEDY), deadline=deadline,
                        user=user, priority=priority if policy == "priority" else 0))
            for output in engine.step():
                if output.finished:
                    finished[output.request_id], outputs[output.request_id] = step, output.token_ids
            step += 1
        ran = [[s for s, batch in enumerate(recorder.steps) if any(row[0] == rid for row in batch)]
               for rid in ids]
        runs.append(PolicyRun(policy, ran, [finished[i] for i in ids], [outputs[i] for i in ids],
                              engine.stats()["requests"]["preemptions"]))
    return runs


def draw_policies(runs: list[PolicyRun], path: Path) -> None:
    plt, _ = _pyplot()
    fig, panels = plt.subplots(len(runs), 1, figsize=(11, 2.1 * len(runs)), sharex=True)
    colors = {"alice": "#c98b4a", "bob": "#4f7f6f", "carol": "#5a78a8"}
    labels = [f"{user} {length}t" + (f" due {deadline}s" if deadline else "")
              + (" p1" if priority else "")
              for user, length, _, priority, deadline, _ in POLICY_WORKLOAD]
    for axes, run in zip(panels, runs):
        waits = []
        for row, (request, steps) in enumerate(zip(POLICY_WORKLOAD, run.ran)):
            user, arrival = request[0], request[5]
            axes.plot([arrival, run.finished[row] + 1], [row, row], color="#bbbbbb", lw=1)
            axes.broken_barh([(s, 1) for s in steps], (row - 0.35, 0.7), color=colors[user])
            axes.text(run.finished[row] + 1.3, row, str(sorted(run.finished).index(
                run.finished[row]) + 1), va="center", fontsize=7)
            waits.append(steps[0] - arrival)
        axes.set_yticks(range(len(labels)), labels, fontsize=7)
        axes.invert_yaxis()
        axes.set_title(f"{run.policy}: mean wait for a first step {sum(waits) / len(waits):.1f} "
                       f"steps (bob and carol: {sum(waits[4:]) / 3:.1f}); preempted for the seat: "
                       f"{run.preemptions}", fontsize=9, loc="left")
    panels[-1].set_xlabel("engine step (one seat; grey: waiting, colour: computing; the number "
                          "is the finish order)")
    fig.suptitle("The same arrivals under each scheduling policy: alice's four long jobs at "
                 "step 0, bob's two short ones at step 4, carol's at step 8\n(t: prompt "
                 "tokens; due: its deadline; p1: priority 1, which only the priority policy "
                 "reads)", fontsize=10)
    _save(fig, path)


# --------------------------------------------------------------------------- 10. experts
@dataclass
class ExpertLoad:
    """Every routing decision of a run on a mixture-of-experts model, counted."""

    num_experts: int
    top_k: int
    tokens: int  # tokens through the model; each went through every sparse layer once
    per_layer: list[list[int]]  # [sparse layer][expert]: (token, k) pairs routed there
    decode_steps: list[tuple[int, list[int]]]  # (batch size, each layer's experts that ran)


def collect_expert_load(model: str) -> ExpertLoad:
    """Twenty requests of mixed lengths, their prompts prefilled in chunks and their
    answers decoded in batches that shrink as requests finish: which experts each sparse
    layer's `route` chose, step by step, as the engine ran them."""
    engine = LLMEngine(model, page_size=8, num_pages=256, chunk_size=96, **ON_THE_CPU)
    recorder = StepRecorder()
    observe(engine, recorder)
    blocks = [layer.mlp for layer in engine.runner.model.model.layers if hasattr(layer.mlp, "experts")]
    routed: list[list[torch.Tensor]] = [[] for _ in blocks]  # per layer, per step: ids [T, k]
    for block, calls in zip(blocks, routed):
        block.route = _recording(block.route, calls)
    generator = torch.Generator().manual_seed(5)
    for i in range(20):
        prompt = torch.randint(50, 750, (8 + 5 * i,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=6 + 2 * i, **GREEDY))
    _run_until_idle(engine)
    num_experts = blocks[0].experts.num_experts
    per_layer = [torch.bincount(torch.cat(calls).flatten(), minlength=num_experts).tolist()
                 for calls in routed]
    decode_steps = [
        (len(rows), [len(calls[step].unique()) for calls in routed])
        for step, rows in enumerate(recorder.steps) if all(n == 1 for _, n, *_ in rows)
    ]
    tokens = sum(n for rows in recorder.steps for _, n, *_ in rows)
    return ExpertLoad(num_experts, blocks[0].num_experts_per_tok, tokens, per_layer, decode_steps)


def _recording(route: Any, calls: list[torch.Tensor]) -> Any:
    def recorded(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        expert_ids, weights = route(hidden)
        calls.append(expert_ids.clone())
        return expert_ids, weights

    return recorded


def draw_expert_load(load: ExpertLoad, path: Path) -> None:
    plt, _ = _pyplot()
    fig, (heat, steps) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    shares = torch.tensor(load.per_layer, dtype=torch.float32) / load.tokens
    image = heat.imshow(shares.numpy(), cmap="viridis", aspect="auto")
    heat.set_xlabel("expert")
    heat.set_ylabel("sparse layer")
    heat.set_yticks(range(len(load.per_layer)))
    heat.set_title(f"Share of the run's {load.tokens} tokens each expert got "
                   f"(top-{load.top_k} of {load.num_experts};\nuniform would be "
                   f"{load.top_k / load.num_experts:.3f} everywhere)", fontsize=10)
    fig.colorbar(image, ax=heat, fraction=0.04)
    sizes = [size for size, _ in load.decode_steps]
    ran = [sum(layers) / len(layers) for _, layers in load.decode_steps]
    steps.scatter(sizes, ran, s=14, color="#3060a0", label="a decode step (mean over layers)")
    batch = range(1, max(sizes) + 1)
    uniform = [load.num_experts * (1 - (1 - load.top_k / load.num_experts) ** b) for b in batch]
    steps.plot(batch, uniform, color="#aa3333", lw=1,
               label="uniform routing: E·(1 − (1 − k/E)^B)")
    steps.axhline(load.num_experts, color="#888888", ls=":", lw=1)
    steps.set_xlabel("decode batch size B")
    steps.set_ylabel("experts that ran")
    steps.set_ylim(0, load.num_experts + 1)
    steps.set_title("Experts a decode step runs: the grouped loop\nskips the rest", fontsize=10)
    steps.legend(fontsize=8, loc="lower right")
    _save(fig, path)


# --------------------------------------------------------------------------- 11. the two pools
@dataclass
class PoolsStep:
    pages: tuple[int, int, int]  # KV pages used, cached, free
    slots: tuple[int, int, int]  # state slots running, snapshots, free
    running: int  # requests running
    restored: list[int]  # cached prompt tokens of each request whose first token came now


def collect_pools(model: str) -> list[PoolsStep]:
    """A hybrid model serving ten chats that share a system prompt, each sent a second
    turn (its prompt, its reply, a new message) as soon as it finishes: KV pages and state
    slots side by side, step by step."""
    engine = LLMEngine(model, page_size=8, num_pages=100, chunk_size=64, max_num_seqs=8,
                       **ON_THE_CPU)
    system = list(range(30, 78))  # six pages every request starts with
    arrivals = {6 * i: [(system + [100 + 9 * i + j for j in range(8 + 3 * i)], 16)] for i in range(10)}
    history: list[PoolsStep] = []
    first_turns: set[str] = set()
    seen: set[str] = set()
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for prompt, max_tokens in arrivals.pop(step, []):
            request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
            if max_tokens == 16:
                first_turns.add(request_id)
        restored = []
        for output in engine.step():
            if output.request_id not in seen:
                seen.add(output.request_id)
                restored.append(output.num_cached_tokens)
            if output.finished and output.request_id in first_turns:  # its second turn
                follow_up = output.prompt_token_ids + output.token_ids + [700, 701, 702, 703]
                arrivals.setdefault(step + 1, []).append((follow_up, 8))
        stats = engine.stats()
        pages, slots = stats["kv_cache"], stats["state_pool"]
        history.append(PoolsStep(
            (pages["pages_used"], pages["pages_cached"], pages["pages_free"]),
            (slots["slots_running"], slots["slots_snapshots"], slots["slots_free"]),
            stats["requests"]["running"], restored,
        ))
        step += 1
    return history


def draw_pools(history: list[PoolsStep], path: Path) -> None:
    plt, _ = _pyplot()
    fig, (kv, states) = plt.subplots(2, 1, figsize=(11.5, 5.6), sharex=True)
    steps = range(len(history))
    kv.stackplot(steps, *zip(*(h.pages for h in history)),
                 labels=["in use", "cached (evictable)", "free"],
                 colors=["#5b8e7d", "#8cb4d8", "#eeeeee"])
    kv.set_ylabel("KV pages")
    kv.set_title("The two pools of a hybrid model: KV pages for its full-attention layers "
                 "(above),\nstate slots for its Gated DeltaNet layers (below); a triangle: a "
                 "request whose first tokens came from the cache (how many)", fontsize=10)
    states.stackplot(steps, *zip(*(h.slots for h in history)),
                     labels=["running (one a request)", "snapshots (evictable)", "free"],
                     colors=["#c98b4f", "#e8c89a", "#eeeeee"])
    states.set_ylabel("state slots")
    states.set_xlabel("engine step")
    total = sum(history[0].slots)
    for step, entry in enumerate(history):
        for cached in entry.restored:
            if cached:
                states.plot(step, total + 0.3, marker="v", color="#3060a0", ms=6, clip_on=False)
                states.text(step, total + 0.7, str(cached), ha="center", fontsize=6)
    states.set_ylim(0, total + 1.2)
    for axes in (kv, states):
        axes.set_xlim(0, len(history) - 1)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    _save(fig, path)


# --------------------------------------------------------------------------- all of them
PICTURES = {
    "page_table.png": (collect_page_table, draw_page_table),
    "radix_tree.png": (collect_radix_tree, lambda data, path: draw_radix_tree(data[0], path)),
    "chunked_prefill.png": (collect_timeline, lambda data, path: draw_timeline(*data, path)),
    "speculation.png": (collect_speculation, draw_speculation),
    "tensor_parallel.png": (collect_tensor_parallel, lambda data, path: draw_tensor_parallel(*data, path)),
    "kv_pool.png": (collect_pool, draw_pool),
    "one_step.png": (collect_one_step, draw_one_step),
    "load.png": (collect_load, draw_load),
    "policies.png": (collect_policies, draw_policies),
}
# The pictures of the other model kinds, each with the kind of tiny checkpoint it is drawn
# from: `tools/checkpoints.py`'s builder of that kind, with these overrides (more experts
# than the tests' model, so that a decode batch does not reach them all).
KIND_PICTURES = {
    "expert_load.png": ("qwen3_moe", collect_expert_load, draw_expert_load),
    "hybrid_pools.png": ("qwen3_5", collect_pools, draw_pools),
}
KIND_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=4, num_hidden_layers=4),
    "qwen3_5": {},
}


def build_kind(kind: str, directory: str | Path) -> str:
    """The tiny checkpoint of `kind` that its pictures are drawn from."""
    from tools import checkpoints

    return getattr(checkpoints, f"build_{kind}")(directory, **KIND_OVERRIDES[kind])


def draw_all(model: str, out: Path, kind_models: dict[str, str] | None = None) -> list[Path]:
    """Every picture: `PICTURES` of the dense `model`, `KIND_PICTURES` of `kind_models`
    (those not given are built here)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (collect, draw) in PICTURES.items():
        draw(collect(model), out / name)
        written.append(out / name)
    with tempfile.TemporaryDirectory() as scratch:
        models = dict(kind_models or {})
        for name, (kind, collect, draw) in KIND_PICTURES.items():
            if kind not in models:
                models[kind] = build_kind(kind, Path(scratch) / kind)
            draw(collect(models[kind]), out / name)
            written.append(out / name)
    return written


def _run_until_idle(engine: LLMEngine) -> list[Any]:
    finished = []
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    return finished


def _walk(node: TreeNode) -> Iterator[TreeNode]:
    yield node
    for child in node.children:
        yield from _walk(child)


def _shorten(text: str, limit: int) -> str:
    """One line of printable ASCII (the random models' replies are any bytes at all)."""
    text = "".join(c if " " <= c <= "~" else "⏎" if c == "\n" else "·" for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _pyplot() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    return plt, patches


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    # No timestamps in the file, so the same pictures are the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    _pyplot()[0].close(fig)


@contextmanager
def _tiny_checkpoint() -> Iterator[str]:
    from tools.checkpoints import build_qwen3

    with tempfile.TemporaryDirectory() as directory:
        yield build_qwen3(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint directory (default: the tiny test Qwen3)")
    parser.add_argument("--out", type=Path, default=IMAGE_DIR, help="where the PNGs go")
    args = parser.parse_args()
    # One thread: tiny models gain nothing from more, and float sums then add up in one
    # order, so the same code draws the same pictures.
    torch.set_num_threads(1)
    with nullcontext(args.model) if args.model else _tiny_checkpoint() as model:
        for path in draw_all(model, args.out):
            print(path)


if __name__ == "__main__":
    main()
