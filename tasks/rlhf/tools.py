"""Tools a policy may call inside a multi-turn GRPO episode (rlhf.tools), the tool-call parser and how an episode
ends. No torch here: tasks/rlhf/episodes.py runs the episodes with the model.

A tool call follows the ChatML / Hermes convention (Qwen2.5, SmolLM2, Hermes templates): the assistant writes

    <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>

and the episode appends the tool's result as a `tool` turn, rendered by the checkpoint's own chat template, then lets
the model continue. A reply without `<tool_call>` is the model's answer: the episode is finished.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass
from enum import Enum

from . import sandbox


class EpisodeEnd(str, Enum):
    """Why an episode ended (the stage's summary counts each)."""

    FINISHED = "finished"                        # the model answered without calling a tool
    MAX_TURNS = "max_turns"                      # rlhf.max_turns model turns, the last one still calling a tool
    LENGTH = "length"                            # max_completion_length tokens (model and tool turns) used up
    MALFORMED_TOOL_CALL = "malformed_tool_call"  # <tool_call> without valid JSON, a known tool or its arguments
    TOOL_RAISED = "tool_raised"                  # the tool (or the code it ran) raised
    TOOL_TIMED_OUT = "tool_timed_out"            # the tool ran past rlhf.tool_timeout_s and was killed
    ENVIRONMENT_RAISED = "environment_raised"    # rlhf.environment's reset or step raised (or returned nonsense)
    ENVIRONMENT_TIMED_OUT = "environment_timed_out"  # its call ran past rlhf.tool_timeout_s: its process killed


BUILT_IN = ("calculator", "python")
CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    """A model turn read for a tool call: call is None and problem None for an answer; problem says why a
    `<tool_call>` cannot be run."""

    call: ToolCall | None = None
    problem: str | None = None


ARGUMENTS = {"calculator": ("expression",), "python": ("code",)}


def parse_tool_call(text: str, tools: tuple[str, ...] | list[str]) -> Parsed:
    """The first tool call of a model turn: its JSON object with a `name` among `tools` and exactly that tool's
    string arguments."""
    if OPEN_TAG not in text:
        return Parsed()
    found = CALL.search(text)
    if not found.group(2):
        return Parsed(problem="<tool_call> is not closed by </tool_call>")
    try:
        obj = json.loads(found.group(1))
    except json.JSONDecodeError as e:
        return Parsed(problem=f"not JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return Parsed(problem='expected {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj["arguments"]
    if name not in tools:
        return Parsed(problem=f"unknown tool {name!r} (available: {', '.join(tools)})")
    wanted = ARGUMENTS[name]
    if not isinstance(args, dict) or set(args) != set(wanted) or not all(isinstance(v, str) for v in args.values()):
        return Parsed(problem=f"{name} takes the string arguments {', '.join(wanted)}")
    return Parsed(ToolCall(name, args))


# ---- the calculator: arithmetic on numbers, nothing else (no names, no calls, bounded powers) -----------------------
class ToolRaised(Exception):
    """The tool's call failed (the message is shown to nobody but the logs: the episode ends)."""


OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION = 200
MAX_EXPONENT = 64     # and |base| ≤ 1e6: a power stays small enough to compute at once (no 9**9**9)
MAX_MAGNITUDE = 1e100


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > 1e6):
            raise ToolRaised(f"power {left}**{right} too large")
        result = OPERATORS[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ToolRaised("result out of range")
        return result
    raise ToolRaised(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """+ - * / // % ** and parentheses on numbers: `3+4` → `7`, `7/2` → `3.5`."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolRaised(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolRaised(f"not an expression ({e.msg})") from None
    try:
        value = _value(tree.body)
    except (ZeroDivisionError, OverflowError, ValueError) as e:
        raise ToolRaised(f"{type(e).__name__}: {e}") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return str(value)


# ---- running a call --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolResult:
    """The tool's output (the next turn's text), or the end it caused."""

    text: str
    end: EpisodeEnd | None = None


PYTHON_MEMORY_MB = 512


def run_tool(call: ToolCall, timeout_s: float) -> ToolResult:
    """One call of a built-in tool. The python tool runs the code in the sandbox of the code_tests reward
    (tasks/rlhf/sandbox.py: namespaces, Landlock, seccomp, limits), killed after timeout_s; the calculator cannot
    hang (bounded input, bounded powers)."""
    if call.name == "calculator":
        try:
            return ToolResult(calculator(call.arguments["expression"]))
        except ToolRaised as e:
            return ToolResult(str(e), EpisodeEnd.TOOL_RAISED)
    run = sandbox.run_tool_code(call.arguments["code"], sandbox.Limits(timeout_s=timeout_s,
                                                                       memory_mb=PYTHON_MEMORY_MB,
                                                                       isolation="required"))
    if run.timed_out:
        return ToolResult(f"timed out after {timeout_s:g} s", EpisodeEnd.TOOL_TIMED_OUT)
    if run.raised is not None:
        return ToolResult(run.raised, EpisodeEnd.TOOL_RAISED)
    return ToolResult(run.printed)
