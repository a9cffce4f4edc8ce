"""The package's shape: one room per concept, imports running one way, a core that reads in
one sitting, and features that stay out of a plain request's way.

A reader should be able to learn the engine room by room: the KV memory before the
scheduler that hands it out, the attention backends before the runner that drives them,
the engine before the server that wraps it. That only works if no room reaches up (or
around, in a circle) to something a later room explains. These tests parse every module's
imports and hold them to the tiers the README's map draws. Optional features (speculative
decoding, tensor parallelism, quantized weight formats, grammars, logprobs, the server)
attach at hooks the core calls without knowing who is behind them; what a plain engine
imports, and what one plain request runs, are measured, not guessed from words.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoqwen"
# Lowest tier first. A room may import rooms of its own tier or of a lower one, never of a
# higher one; no imports may form a cycle, between rooms or between modules.
TIERS = [
    {"config", "outputs", "memory"},
    {"attention", "sampling"},
    {"model"},
    {"weights", "text"},
    {"scheduling", "runner"},
    {"parallel", "speculative"},
    {"stats", "engine", "llm"},
    {"__init__", "cli", "metrics", "server"},
]
MAX_MODULE_LINES = 400
MAX_TOP_LEVEL_MODULES = 8
# Modules a plain engine must not load: each is a feature, imported only when used.
FEATURE_MODULES = (
    "nanoqwen.speculative", "nanoqwen.parallel", "nanoqwen.weights.gguf",
    "nanoqwen.weights.gptq_awq", "nanoqwen.weights.quantization", "nanoqwen.sampling.grammar",
    "nanoqwen.sampling.logprobs", "nanoqwen.sampling.penalties", "nanoqwen.sampling.pooling",
    "nanoqwen.server", "nanoqwen.memory.kv_quant",
    "nanoqwen.runner.memory_profile", "nanoqwen.runner.cuda_graph",
    "nanoqwen.scheduling.policies", "nanoqwen.scheduling.swapping", "nanoqwen.memory.swap",
)
# One plain request (`LLM.generate`, CPU, float32, reference attention) may run at most
# this much of the package: the teaching core's budget (docs/learn/00-core.md).
CORE_BUDGET = {"functions": 80, "files": 16, "lines": 3000}


def room_of(path: Path) -> str:
    """`nanoqwen/x.py` → "x"; `nanoqwen/room/y.py` → "room"."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """The dotted nanoqwen modules (or packages) `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from package import module` imports that module; `from module import name`,
            # the module itself.
            base = absolute_module(node, path)
            names = [
                f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if is_module(name))
    return found


def absolute_module(node: ast.ImportFrom, path: Path) -> str:
    """The dotted module a `from ... import` reads, with relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(PACKAGE.parent).parts[:-1])
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "nanoqwen" or len(parts) < 2:
        return False
    target = PACKAGE.parent.joinpath(*parts)
    return target.with_suffix(".py").exists() or target.is_dir()


def module_graph() -> dict[str, set[str]]:
    return {dotted(path): imported_modules(path) - {dotted(path)} for path in modules()}


def room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in modules():
        rooms = {name.split(".")[1] for name in imported_modules(path)}
        graph.setdefault(room_of(path), set()).update(rooms - {room_of(path)})
    return graph


def tier_of(room: str) -> int:
    for index, tier in enumerate(TIERS):
        if room in tier:
            return index
    raise AssertionError(f"nanoqwen/{room} is in no tier: add it to TIERS and the README's map")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for target in sorted(graph.get(name, ())):
            if (cycle := visit(target, [*path, name])) is not None:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        if (cycle := visit(name, [])) is not None:
            return cycle
    return None


def test_every_room_has_a_tier() -> None:
    for room in room_graph():
        tier_of(room)


def test_no_import_runs_up_the_tiers() -> None:
    upward = [
        f"{room} → {target}"
        for room, targets in room_graph().items()
        for target in targets
        if tier_of(target) > tier_of(room)
    ]
    assert not upward, f"imports that run up the tiers: {upward}"


@pytest.mark.parametrize("graph", [room_graph, module_graph], ids=["rooms", "modules"])
def test_no_import_cycles(graph) -> None:
    cycle = find_cycle(graph())
    assert cycle is None, f"import cycle: {' → '.join(cycle)}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name} has {lines} lines"


def test_few_modules_sit_directly_in_the_package() -> None:
    top_level = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level


# Run in a fresh interpreter: what one plain request imports and runs, measured with
# `sys.setprofile` (every call of a nanoqwen function, by file and qualified name). Every
# step reads how busy the cores are, as a step does twice a second on a running engine:
# the count is the same on a quiet machine and a busy one.
PLAIN_REQUEST = textwrap.dedent("""
    import json, os, sys
    import nanoqwen.engine
    after_import = sorted(sys.modules)
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.runner import cpu_threads
    cpu_threads.INTERVAL_S = 0.0
    package = os.path.dirname(nanoqwen.__file__)
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="reference")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(["hello world"], params)  # first calls and lazy imports out of the way
    seen = set()
    def note(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(package):
            seen.add((os.path.relpath(path, package), frame.f_code.co_qualname))
    sys.setprofile(note)
    llm.generate(["the quick brown fox"], params)
    sys.setprofile(None)
    files = sorted({path for path, _ in seen})
    print(json.dumps({
        "imported": after_import, "loaded": sorted(sys.modules), "functions": len(seen),
        "files": files, "lines": sum(len(open(os.path.join(package, f)).readlines()) for f in files),
    }))
""")


@pytest.fixture(scope="module")
def plain_request(qwen3_dir: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PLAIN_REQUEST, qwen3_dir], capture_output=True,
                            text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.splitlines()[-1])


def features_in(modules: list[str]) -> list[str]:
    return [name for name in modules if name.startswith(FEATURE_MODULES)]


def test_importing_the_engine_loads_no_feature(plain_request: dict) -> None:
    assert features_in(plain_request["imported"]) == []


def test_serving_a_plain_request_loads_no_feature(plain_request: dict) -> None:
    assert features_in(plain_request["loaded"]) == []


def test_one_plain_request_reads_in_one_sitting(plain_request: dict) -> None:
    measured = {"functions": plain_request["functions"], "files": len(plain_request["files"]),
                "lines": plain_request["lines"]}
    assert all(measured[key] <= CORE_BUDGET[key] for key in CORE_BUDGET), measured


def test_the_core_note_lists_the_files_a_plain_request_runs(plain_request: dict) -> None:
    """Every file one plain request runs is in the teaching core's list, with its line
    count as it is (docs/learn/00-core.md)."""
    note = (ROOT / "docs" / "learn" / "00-core.md").read_text()
    listed = dict(re.findall(r"\[nanoqwen/([\w/]+\.py)\]\([^)]*\) \| (\d+) \|", note))
    assert set(plain_request["files"]) <= set(listed)
    for path, lines in listed.items():
        assert int(lines) == len((PACKAGE / path).read_text().splitlines()), path


@pytest.mark.parametrize(
    "room", sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists())
)
def test_every_module_is_named_in_its_rooms_init(room: str) -> None:
    """Each room's `__init__` says what to read in it: every module of the room."""
    guide = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())) or ""
    missing = [
        path.name for path in sorted((PACKAGE / room).glob("*.py"))
        if path.name != "__init__.py"
        and f"`{path.name}`" not in guide and f"`{path.stem}`" not in guide
    ]
    assert not missing, f"nanoqwen/{room}/__init__.py does not name {missing}"


def readme_rooms() -> list[list[str]]:
    """The rooms of each row of the README's map, top to bottom."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Where things live", 1)[1].split("\n\n", 2)[2]
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    return [[room_of(PACKAGE / link.removeprefix("nanoqwen/"))
             for link in re.findall(r"\]\((nanoqwen/[\w/.]+)\)", row.split(" | ")[0])]
            for row in rows]


def test_the_readme_map_runs_down_the_tiers() -> None:
    """Imports run one way, down the README's table: each row's rooms share a tier, every
    room is there, and the tiers only fall from one row to the next."""
    rows = readme_rooms()
    tiers = [{tier_of(room) for room in row} for row in rows]
    assert all(len(tier) == 1 for tier in tiers), rows
    order = [tier.pop() for tier in tiers]
    assert order == sorted(order, reverse=True), rows
    documented = {room for row in rows for room in row}
    assert set(room_graph()) - {"__init__"} <= documented


def test_the_checker_sees_imports() -> None:
    """The parser itself: it must find the imports it is meant to police."""
    graph = room_graph()
    assert {"memory", "runner", "scheduling"} <= graph["engine"]
    assert "attention" in graph["model"] or "attention" in graph["runner"]
    assert "nanoqwen.scheduling.request" in module_graph()["nanoqwen.scheduling.scheduler"]


def test_relative_imports_resolve() -> None:
    tree = ast.parse("from ..memory import kv_pool\nfrom . import routes")
    path = PACKAGE / "server" / "handler.py"
    relative, package_level = tree.body
    assert absolute_module(relative, path) == "nanoqwen.memory"
    assert absolute_module(package_level, path) == "nanoqwen.server"


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
