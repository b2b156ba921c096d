"""The package's shape: fsdp2/'s subpackages are layers, and every import
inside fsdp2/ (lazy imports inside functions and the ones under ``if
TYPE_CHECKING:`` included: a layer that names a type from above is a layer
out of place) stays in its layer or goes down, never up and never round in a
circle. Each layer says what it holds, and no file grows past 450 lines
or holds only a small helper."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp2"
MAX_LINES = 450
# A file shorter than this holds a concept of its own, or is merged where it is used.
MIN_LINES = 40
SMALL_ON_PURPOSE = {
    "base/version.py": "read by the build (pyproject.toml) without importing torch",
    "base/log.py": "fsdp2's logger, which five files of three layers use",
}
# Bottom first; docs/design.md, "The package's layers", says what each holds.
LAYERS = ("base", "comm", "engine", "checks", "optim", "api")


def _layer(module: str) -> int:
    """The layer of ``fsdp2.<layer>.<file>``; the package itself (its
    ``__init__``, the public names) sits above them all."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(
    name: str, is_package: bool, source: str, modules: set[str], type_only: bool = False
) -> set[str]:
    """The modules of ``modules`` that module ``name`` (whose text is ``source``)
    imports when it runs, at import or at call time (``type_only``: and under
    ``if TYPE_CHECKING:``)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from . import x` names a module
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    found.discard(name)
    # A submodule's import of its own package runs the package's __init__,
    # which imports the submodule: not an arrow that makes a cycle.
    return {m for m in found if not name.startswith(f"{m}.")}


def _import_graph(type_only: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {
        _module_name(p): _runtime_imports(
            _module_name(p), p.name == "__init__.py", p.read_text(), modules, type_only
        )
        for p in paths
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_every_module_is_in_a_layer() -> None:
    strays = [m for m in _import_graph() if m != "fsdp2" and m.split(".")[1] not in LAYERS]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_imports_never_run_up_a_layer() -> None:
    graph = _import_graph(type_only=True)
    assert graph["fsdp2.api.state"], "the graph should see state.py's imports"
    upward = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        for imported in imports
        if _layer(imported) > _layer(module)
    )
    assert not upward, (
        "imports running up the layers " + " < ".join(LAYERS) + ":\n" + ("\n".join(upward))
    )


def test_the_layer_check_can_fail() -> None:
    assert _layer("fsdp2.base.policy") < _layer("fsdp2.comm.primitives") < _layer("fsdp2.api.state")
    assert _layer("fsdp2") > _layer("fsdp2.api.module")
    with pytest.raises(ValueError):
        _layer("fsdp2.elsewhere.x")


def test_runtime_imports_have_no_cycle() -> None:
    graph = _import_graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in fsdp2/: " + " -> ".join(cycle or [])


def test_imports_have_no_cycle_with_type_only_ones() -> None:
    cycle = _cycle(_import_graph(type_only=True))
    assert cycle is None, "import cycle in fsdp2/ (type-only imports counted): " + " -> ".join(
        cycle or []
    )


def test_the_check_sees_lazy_imports_and_skips_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import d\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from .c import C\n"
    )
    modules = {"fsdp2", "fsdp2.a", "fsdp2.b", "fsdp2.c", "fsdp2.d"}
    assert _runtime_imports("fsdp2.a", False, source, modules) == {"fsdp2.c", "fsdp2.d"}
    with_types = _runtime_imports("fsdp2.a", False, source, modules, type_only=True)
    assert with_types == {"fsdp2.b", "fsdp2.c", "fsdp2.d"}
    assert _cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    assert _cycle({"x": {"y"}, "y": set()}) is None


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_file_over_450_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it by concept"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_small_file_without_a_reason(path: Path) -> None:
    name = path.relative_to(PACKAGE).as_posix()
    lines = len(path.read_text().splitlines())
    if path.name == "__init__.py" or name in SMALL_ON_PURPOSE:
        return
    assert lines >= MIN_LINES, f"{name} has {lines} lines: merge it where it is used"


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_says_what_it_holds(layer: str) -> None:
    init = PACKAGE / layer / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) > 20, (
        f"fsdp2/{layer}/__init__.py needs a docstring saying what it holds"
    )


def test_public_objects_pickle_under_the_package_name() -> None:
    """A pickled policy names ``fsdp2.<Name>``, not the file it lives in, so a
    config saved today loads after the next move of a file."""
    import torch

    import fsdp2

    for name in set(fsdp2.__all__) - {"__version__"}:
        assert getattr(fsdp2, name).__module__ == "fsdp2", name
    policies = [
        fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        fsdp2.CPUOffloadPolicy(pin_memory=False),
        fsdp2.CompressionPolicy(weights="int8"),
    ]
    for policy in policies:
        data = pickle.dumps(policy)
        assert b"fsdp2.base" not in data and pickle.loads(data) == policy
