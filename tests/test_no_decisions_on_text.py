"""States, outcomes and decisions are enums or typed fields, never read back from message text. The decision sites
(flows/, tasks/, conversions/) are read as source: no branch tests an exception's text (`"No space left" in str(e)`),
a message the code composed itself (`was = f"…serving"; was.endswith("serving")`), or a state by a prefix or suffix of
its enum value (`status.endswith("ed")`)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
PACKAGES = ("flows", "tasks", "conversions")
TEXT_TESTS = ("startswith", "endswith", "find", "index", "count")


def _sources() -> list[tuple[str, ast.Module]]:
    return [(f.relative_to(REPO).as_posix(), ast.parse(f.read_text()))
            for pkg in PACKAGES for f in sorted((REPO / pkg).rglob("*.py"))]


def _enum_values(sources: list[tuple[str, ast.Module]]) -> set[str]:
    """Every string value of a StrEnum defined in the project (Status, Failure, EngineCause, Why…)."""
    values = set()
    for _, tree in sources:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if any(isinstance(b, ast.Name) and b.id == "StrEnum" for b in cls.bases):
                values |= {a.value.value for a in cls.body if isinstance(a, ast.Assign)
                           and isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)}
    return values


def _text_of_exception(node: ast.AST, caught: set[str]) -> bool:
    """str(e) / repr(e) / e.args of a name an `except … as e` bound."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr", "format"):
        return bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in caught
    return isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name) \
        and node.value.id in caught


def _composed(scope: ast.AST) -> set[str]:
    """Names a function assigns a message it composes (an f-string, or a sum with one)."""
    def is_text(v):
        return isinstance(v, ast.JoinedStr) or (isinstance(v, ast.BinOp) and (is_text(v.left) or is_text(v.right)))
    return {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and is_text(n.value)
            for t in n.targets if isinstance(t, ast.Name)}


def decisions_on_text(path: str, tree: ast.Module, enum_values: set[str]) -> list[str]:
    """'path:line what' for each branch on message text in one module."""
    caught = {h.name for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.name}
    found = []
    for scope in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        composed = _composed(scope)
        for n in ast.walk(scope):
            if isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops) \
                    and any(_text_of_exception(c, caught) for c in n.comparators):
                found.append(f"{path}:{n.lineno} tests an exception's text with `in`")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in TEXT_TESTS:
                receiver, args = n.func.value, n.args
                if _text_of_exception(receiver, caught):
                    found.append(f"{path}:{n.lineno} tests an exception's text with .{n.func.attr}")
                elif isinstance(receiver, ast.Name) and receiver.id in composed:
                    found.append(f"{path}:{n.lineno} tests the message it composed ({receiver.id}.{n.func.attr})")
                elif n.func.attr in ("startswith", "endswith") and args and isinstance(args[0], ast.Constant) \
                        and args[0].value in enum_values:
                    found.append(f"{path}:{n.lineno} tests a state by its text (.{n.func.attr}({args[0].value!r}))")
    return found


def test_no_decision_reads_message_text():
    sources = _sources()
    values = _enum_values(sources)
    assert {"completed", "cached", "refused", "code changed"} <= values  # the enums were found: the check can fail
    found = [line for path, tree in sources for line in decisions_on_text(path, tree, values)]
    assert not found, "decide on an enum, an errno or a typed field instead:\n" + "\n".join(found)


FOUND = {  # one of each kind the check names, as main had the first two
    "exception text": """
def f(p):
    try:
        p.write_text('x')
    except OSError as e:
        if 'No space left' in str(e):
            return 1
""",
    "a composed message": """
def f(alive):
    was = f'v1, ' + ('serving' if alive else 'down')
    return was.endswith('serving')
""",
    "an enum value's suffix": """
def f(status):
    return status.endswith('completed')
""",
    "exception text, by prefix": """
def f():
    try:
        pass
    except Exception as exc:
        return str(exc).startswith('CUDA out of memory')
""",
}


@pytest.mark.parametrize("snippet", FOUND.values(), ids=FOUND.keys())
def test_the_check_finds_each_kind_it_names(snippet):
    assert decisions_on_text("x.py", ast.parse(snippet), {"completed"})
