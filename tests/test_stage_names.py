"""A stage declares what it is once (its StageSpec, registered in tasks/registry.py); the modules listed here ask the
registered stages (their role, their formats) and never compare with a stage's name. Read from the source."""
from __future__ import annotations

import ast

import pytest

from conftest import REPO
from tasks.registry import STAGES

pytestmark = pytest.mark.fast
NAME_FREE = ("flows/chain_planner.py",)  # extend as each module stops naming stages (issue 38)


def name_comparisons(tree: ast.Module) -> list[int]:
    """Lines that compare with a stage's name: `== "rlhf"`, `!= "data"`, `in ("data", "convert")`."""
    def names_a_stage(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in STAGES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_a_stage(e) for e in node.elts)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(names_a_stage(side) for side in (n.left, *n.comparators))]


@pytest.mark.parametrize("module", NAME_FREE)
def test_the_module_names_no_stage(module):
    assert name_comparisons(ast.parse((REPO / module).read_text())) == []


def test_the_check_finds_each_spelling():
    code = "a == 'rlhf'\nb != \"data\"\nc in ('data', 'convert')\n'serve' not in d\n"
    assert name_comparisons(ast.parse(code)) == [1, 2, 3, 4]
