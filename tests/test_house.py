"""House rules the code keeps: small functions, imports one way (flows → tasks → conversions), no import cycle."""
from __future__ import annotations

import ast
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
