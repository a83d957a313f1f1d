"""House rules the code keeps: small functions, imports one way (flows → tasks → conversions), no import cycle."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
PACKAGES = ("flows", "tasks", "conversions")
MAX_FUNCTION_LINES = 80


def _modules():
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            yield f, ast.parse(f.read_text())


def test_no_function_is_longer_than_the_limit():
    long = [f"{f.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for f, tree in _modules() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def _imported_packages(tree) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names.add(n.module.split(".")[0])
    return names


def test_imports_go_one_way():
    allowed = {"flows": {"flows", "tasks", "conversions"}, "tasks": {"tasks", "conversions"}, "conversions": {"conversions"}}
    wrong = []
    for f, tree in _modules():
        pkg = f.relative_to(REPO).parts[0]
        for used in _imported_packages(tree) & set(PACKAGES):
            if used not in allowed[pkg]:
                wrong.append(f"{f.relative_to(REPO)} imports {used}")
    assert not wrong, "\n".join(wrong)


def test_conversions_never_import_prefect_or_mlflow():
    bad = [str(f.relative_to(REPO)) for f, tree in _modules()
           if f.relative_to(REPO).parts[0] == "conversions" and _imported_packages(tree) & {"prefect", "mlflow"}]
    assert not bad, bad


def _module_name(f: Path) -> str:
    parts = f.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: none inside a function (they run when it is
    called, the usual way out of a cycle) and none under `if TYPE_CHECKING:` (they never run)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def _imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules an import statement loads: `from pkg import sub` names the submodule when there is one."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & known
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names} & known


def _import_graph() -> dict[str, set[str]]:
    trees = {_module_name(f): (f, tree) for f, tree in _modules()}
    known = set(trees)
    return {name: set().union(*(_imported_modules(n, name, f.name == "__init__.py", known)
                                 for n in _import_time_imports(tree))) - {name}
            for name, (f, tree) in trees.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path that ends where it starts, or [] (depth-first, sorted for a stable answer)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_the_import_graph_has_no_cycle():
    graph = _import_graph()
    assert graph["flows.step_runner"] >= {"tasks.launch", "conversions.manifest"}, "the graph lost the imports it is made of"
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle at import time: " + " → ".join(cycle)
