"""A stage declares what it is once (its StageSpec, registered in tasks/registry.py): every module outside the stages'
own folders asks the registered stages (their role, formats, checks, memory model) and never compares with a stage's
name. Read from the source.

Left out: tests/ (they name the stages they exercise) and benchmarks/ (each measures a named stage's engine against its
bare loop, so it builds that stage's command by name)."""
from __future__ import annotations

import ast

import pytest

from conftest import REPO
from tasks.registry import STAGES

pytestmark = pytest.mark.fast
PACKAGES = ("flows", "tasks", "conversions", "infra")


def name_comparisons(tree: ast.Module) -> list[int]:
    """Lines that compare with a stage's name: `== "rlhf"`, `!= "data"`, `in ("data", "convert")`."""
    def names_a_stage(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in STAGES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_a_stage(e) for e in node.elts)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(names_a_stage(side) for side in (n.left, *n.comparators))]


def outside_the_stages() -> list[str]:
    """Every module of baton's packages but those in a stage's own folder (tasks/<stage>/)."""
    return sorted(str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")
                  if not (p.relative_to(REPO).parts[0] == "tasks" and p.relative_to(REPO).parts[1] in STAGES))


def test_the_scan_covers_the_modules_that_used_to_name_stages():
    modules = outside_the_stages()
    assert {"flows/pipeline.py", "flows/cli/doctor.py", "tasks/memory_plan.py", "tasks/registry.py"} <= set(modules)
    assert not any(m.startswith(tuple(f"tasks/{s}/" for s in STAGES)) for m in modules)


def test_no_module_outside_a_stage_compares_with_a_stage_name():
    found = {m: lines for m in outside_the_stages() if (lines := name_comparisons(ast.parse((REPO / m).read_text())))}
    assert found == {}


def test_the_check_finds_each_spelling():
    code = "a == 'rlhf'\nb != \"data\"\nc in ('data', 'convert')\n'serve' not in d\n"
    assert name_comparisons(ast.parse(code)) == [1, 2, 3, 4]
