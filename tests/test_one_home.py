"""One home per fact: BATON_HOME's default (conversions/home.py) and the lm-eval worker's path (tasks/gates.py) are
written once; every other module imports them. Read from the source (string constants), so a re-spelled copy fails."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
FOLDERS = ("flows", "tasks", "conversions", "infra", "benchmarks")


def _homes_of(fact) -> list[str]:
    """'path:line' of every string constant in the project's code for which fact(text) holds."""
    found = []
    for f in sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and fact(n.value):
                found.append(f"{f.relative_to(REPO)}:{n.lineno}")
    return found


def test_baton_homes_default_is_written_once():
    homes = _homes_of(lambda s: s == ".baton")
    assert [h.split(":")[0] for h in homes] == ["conversions/home.py"], homes


def test_the_lm_eval_workers_path_is_written_once():
    homes = _homes_of(lambda s: s.endswith("lm_eval_worker.py"))
    assert [h.split(":")[0] for h in homes] == ["tasks/gates.py"], homes
