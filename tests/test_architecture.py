"""The package's shape: one room per concept, imports running one way, modules kept short.

A reader should be able to learn the engine room by room: the KV memory before the
scheduler that hands it out, the attention backends before the runner that drives them,
the engine before the server that wraps it. That only works if no room reaches up (or
around, in a circle) to something a later room explains. These tests parse every module's
imports and hold them to the tiers the README's map draws, and they keep optional features
(speculative decoding, tensor parallelism, checkpoint formats) in their own rooms, plugged
into the core through narrow hooks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoqwen"
# Lowest tier first. A room may import rooms of its own tier or of a lower one, never of a
# higher one; no imports may form a cycle, between rooms or between modules.
TIERS = [
    {"config", "memory"},
    {"attention", "sampling"},
    {"model"},
    {"weights", "text", "parallel"},
    {"scheduling", "runner"},
    {"speculative"},
    {"outputs", "stats", "engine", "llm"},
    {"__init__", "cli", "metrics", "server"},
]
MAX_MODULE_LINES = 400
MAX_TOP_LEVEL_MODULES = 8
# Each optional feature's words, and its room. Outside it, at most
# `MAX_FILES_NAMING_A_FEATURE` modules may name the feature (its hook), besides the
# surfaces that list options and figures to users.
FEATURE_WORDS = {
    "speculative": re.compile(r"draft|speculat", re.IGNORECASE),
    "parallel": re.compile(r"all_reduce|tensor_parallel|TensorParallel|\btp\b"),
    "weights": re.compile(r"gguf|gptq|awq", re.IGNORECASE),
}
MAX_FILES_NAMING_A_FEATURE = 2
SURFACES = {"config", "cli", "metrics", "server"}


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


@pytest.mark.parametrize("feature", FEATURE_WORDS)
def test_optional_features_stay_in_their_rooms(feature: str) -> None:
    """Speculative decoding, tensor parallelism and checkpoint formats each plug into the
    core through a narrow hook: few modules outside the feature's room even name it."""
    naming = sorted(
        str(path.relative_to(PACKAGE))
        for path in modules()
        if room_of(path) not in (feature, *SURFACES)
        and FEATURE_WORDS[feature].search(path.read_text())
    )
    assert len(naming) <= MAX_FILES_NAMING_A_FEATURE, f"{feature} is named in {naming}"


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
