"""The package's structure: layers import only downwards, no import cycles (function-level imports included), no
private name used outside its module, and no module over 600 lines."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
REPO = SRC.parent

# Each module's layer: a module may import only from its own layer or the ones below.
LAYERS = {
    "remat.config": 0, "remat.policy": 0, "remat.offload_policy": 0, "remat.timeline": 0, "remat.units": 0,
    "remat.presets": 0,
    "remat.job": 0, "remat.job_flags": 0, "remat.job_experts": 0, "remat.version": 0, "remat.models": 0,
    "remat.job_pipeline": 0, "remat.job_loss": 0, "remat.job_model": 0, "remat.job_launch": 0, "remat.job_fsdp": 0,
    "remat.job_optimizer": 0, "remat.job_argv": 0, "remat.limits": 0, "remat.job_fp8": 0,
    "remat.job_cuda_graphs": 0, "remat.lazy_torch": 0, "remat.config_routing": 0, "remat.job_tp_overlap": 0,
    "remat.job_input": 0, "remat.megatron_script": 0, "remat.files": 0, "remat.cache_state": 0,
    "remat.recompute": 1,
    "remat.memory": 2,
    "remat.parallel": 3, "remat.megatron": 3,
    "remat.plan": 4,
    "remat.analysis": 5,
    "remat.cli": 6,
}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted((SRC / "remat").rglob("*.py"))}


def layer_of(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per run (every structure test walks the same files)."""
    return ast.parse(path.read_text())


def imports_of(path: Path) -> list[tuple[str, str, int]]:
    """(imported remat module, imported name or '', line) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "remat":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    found.append((sub, "", node.lineno))
                else:
                    found.append((node.module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "remat"]
    return found


def private_attributes(path: Path) -> list[str]:
    """``module._name`` uses where ``module`` is a remat module bound by an import (``import remat.x as m``)."""
    tree = parsed(path)
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] == "remat"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "remat":
            aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return [f"{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def import_graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in imports_of(p)} & set(MODULES) for m, p in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_hidden_in_a_function() -> None:
    # The checker itself: a two-module cycle and a self-import are found, a chain is not.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_function_level_imports_are_part_of_the_graph(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from remat.memory.predict import predict\n    return predict\n")
    assert ("remat.memory.predict", "predict", 2) in imports_of(source)


def test_private_attribute_use_is_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import remat.memory.predict as p\np._cache.clear()\np.public()\n")
    assert private_attributes(source) == ["2: p._cache"]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_layers_import_only_downwards() -> None:
    upward = []
    for module, path in MODULES.items():
        if module == "remat":
            continue  # the package's public API re-exports from every layer
        for target, _, line in imports_of(path):
            if target == "remat":
                upward.append(f"{module}:{line} imports the top-level package (import from the defining module)")
            elif target in MODULES and layer_of(target) > layer_of(module):
                upward.append(f"{module}:{line} (layer {layer_of(module)}) imports {target} "
                              f"(layer {layer_of(target)})")
    assert upward == []


def test_no_private_name_is_used_outside_its_module() -> None:
    leaks = []
    for path in [*MODULES.values(), *sorted((REPO / "tests").rglob("*.py")),
                 *sorted((REPO / "benchmarks").rglob("*.py"))]:
        for target, name, line in imports_of(path):
            if name.startswith("_") and not name.startswith("__"):
                leaks.append(f"{path.relative_to(REPO)}:{line} imports {target}.{name}")
        leaks += [f"{path.relative_to(REPO)}:{use}" for use in private_attributes(path)]
    assert leaks == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_600_lines(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by concern"
