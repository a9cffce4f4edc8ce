"""The package's shape: imports run one way, down the layers, and no module grows too long.

A reader should be able to learn the engine bottom-up: the KV pool before the prefix cache
that shares its pages, the attention backends before the runner that drives them, the
engine before the server that wraps it. That only works if no module reaches up (or
around, in a circle) to something a later chapter explains. These tests parse every
module's imports and hold them to the layers the README's module map draws.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoqwen"
# Lowest layer first. A module may import modules of its own layer or of a lower one,
# never of a higher one; within a layer, imports must not form a cycle.
LAYERS = [
    {"config", "kv_pool", "gguf_checkpoint", "parallel"},
    {
        "sampler", "tokenizer", "request", "radix_cache", "attention", "attention_torch",
        "attention_flashinfer", "model", "loader", "batch", "quantization", "gptq_awq",
        "step_broadcast",
    },
    {"cuda_graph", "memory_profile", "scheduler", "runner", "distributed"},
    {"engine"},
    {"__init__", "cli", "metrics", "server"},
]
MAX_MODULE_LINES = 400


def module_name(path: Path) -> str:
    """`nanoqwen/x.py` → "x"; a subpackage's modules all count as the subpackage."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_modules(path: Path) -> set[str]:
    """The nanoqwen modules `path` imports, by `module_name`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_module(node, path)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for parts in (name.split(".") for name in names):
            if parts[0] == "nanoqwen" and len(parts) > 1 and is_module(parts[1]):
                found.add(parts[1])
    return found


def absolute_module(node: ast.ImportFrom, path: Path) -> str:
    """The dotted module a `from ... import` reads, with relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(PACKAGE.parent).parts[:-1])
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name).is_dir()


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        graph.setdefault(name, set()).update(imported_modules(path) - {name})
    return graph


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise AssertionError(f"nanoqwen/{name} is in no layer: add it to LAYERS and the module map")


def test_every_module_has_a_layer() -> None:
    for name in import_graph():
        layer_of(name)


def test_no_import_runs_up_the_layers() -> None:
    upward = [
        f"{name} → {target}"
        for name, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, f"imports that run up the layers: {upward}"


def test_no_import_cycles() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail(f"import cycle: {' → '.join(cycle)}")
        if name in done:
            return
        for target in sorted(graph.get(name, ())):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_modules_stay_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name} has {lines} lines"


def test_the_checker_sees_imports() -> None:
    """The parser itself: it must find the imports it is meant to police."""
    graph = import_graph()
    assert {"radix_cache", "runner", "scheduler"} <= graph["engine"]
    assert "config" in graph["runner"] and "attention" in graph["model"]


def test_relative_imports_resolve(tmp_path: Path) -> None:
    tree = ast.parse("from ..kv_pool import KVPool\nfrom . import batch")
    path = PACKAGE / "server" / "handler.py"
    relative, package_level = tree.body
    assert absolute_module(relative, path) == "nanoqwen.kv_pool"
    assert absolute_module(package_level, path) == "nanoqwen.server"
