"""The package's layering: each module imports only its own layer or the ones below, and no
import circle anywhere (function-local imports count; `if TYPE_CHECKING:` ones do not). The one
exception is the plugin catalog, `methods/registry.py`'s `_load_all`, which loads every method."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
CATALOG = ("kvstack.methods.registry", "_load_all")

# lowest first; a module belongs to the longest prefix that names it (docs/architecture.md)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "kvstack.errors",
            "kvstack.timing",
            "kvstack.progress",
            "kvstack.paths",
            "kvstack.models.config",
            "kvstack.models.registry",
            "kvstack.models.rope",
            "kvstack.models.tokenizer_fix",
        ),
    ),
    ("data", ("kvstack.bench.data", "kvstack.bench.tasks")),
    ("storage", ("kvstack.cache",)),
    ("calibration", ("kvstack.calibrate",)),
    (
        "method interface",
        ("kvstack.methods", "kvstack.methods.base", "kvstack.methods.select", "kvstack.methods.registry"),
    ),
    (
        "methods",
        tuple(
            f"kvstack.methods.{family}"
            for family in ("evict", "learned", "retrieve", "allocate", "quantize", "merge", "lowrank", "crosslayer")
        ),
    ),
    ("stack", ("kvstack.stack",)),
    ("policy", ("kvstack.policy",)),
    ("cache", ("kvstack.cache.cache", "kvstack.cache.slab_cache")),
    (
        "loops",
        (
            "kvstack.generate",
            "kvstack.planning",
            "kvstack.training",
            "kvstack.models",
            "kvstack.models.loading",
            "kvstack.models.prompts",
        ),
    ),
    (
        "entry points",
        (
            "kvstack",
            "kvstack.api",
            "kvstack.cli",
            "kvstack.cli_cache",
            "kvstack.cli_serve",
            "kvstack.cli_eval",
            "kvstack.cli_train",
            "kvstack.harness",
            "kvstack.terminal",
            "kvstack.bench",
            "kvstack.reuse",
            "kvstack.serve",
        ),
    ),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "kvstack").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix naming `module`."""
    best, length = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = i, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvstack modules `module` imports anywhere in its file, but under `if TYPE_CHECKING:` or
    in the catalog's loader."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        type_only = isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        loader = isinstance(node, ast.FunctionDef) and (module, node.name) == CATALOG
        if type_only or loader:
            skipped.update(id(sub) for sub in ast.walk(node))

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in map(resolve, names) if t is not None and t != module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_no_module_imports_a_layer_above_its_own(graph: dict[str, set[str]]) -> None:
    upward = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert not circles, circles


def test_the_checks_see_an_upward_import(tmp_path: Path) -> None:
    """The walk finds a function-local import and skips a type-only one."""
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstack.cli import app\n"
        "def f():\n    from kvstack.generate import Runner\n"
    )
    known = {"kvstack.cache.layer": path, "kvstack.cli": path, "kvstack.generate": path}
    found = imports("kvstack.cache.layer", path, known)
    assert found == {"kvstack.generate"}
    assert layer_of("kvstack.generate") > layer_of("kvstack.cache.layer")
