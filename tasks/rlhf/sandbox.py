"""Run untrusted code against test cases in a sandboxed subprocess (the code_tests reward, tasks/rlhf/rewards.py).

One `python -I` child per run (tasks/rlhf/sandbox_child.py): an empty temporary working folder, a minimal environment,
its own session, stdout and stderr discarded. Inside, before the code runs: RLIMIT_AS / RLIMIT_CPU / RLIMIT_NOFILE /
RLIMIT_FSIZE, no_new_privs, a user + network namespace (no network at all), Landlock (writes only beneath the working
folder; no signal to or ptrace of a process outside), a seccomp filter that fails every socket(2). The limits are set by
the child itself as its first act, not in a preexec_fn: the TRL worker that calls this is multi-threaded, and a
preexec_fn after fork can deadlock there. Here: a wall-clock timeout, after which (and after every run) the child's
whole process group is killed.

Test cases (a column of the prompts data), either kind in one list:
    "assert add(2, 3) == 5"              Python statements run after the code, in its namespace: pass = nothing raised
    {"input": "2 3\\n", "output": "5"}    the code as a program with that stdin: pass = what it printed equals output
                                          (line by line, trailing spaces and blank edges ignored)

What it does not stop: code that reads files the user running baton can read (there is no network to send them
over), or a descendant that starts its own session (it escapes the group kill; RLIMIT_CPU, Landlock and the
namespaces still hold it). The code runs in the same interpreter as the harness, so a program that digs the run's
nonce out of the harness's memory could forge passes: this guards against broken and careless code, not a policy
trained to attack its grader.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import sandbox_child
from conversions.refusal import Refused

CHILD = Path(sandbox_child.__file__)
RESULTS_READ = 1 << 20
MAX_TESTS = 100
ISOLATION = sandbox_child.ISOLATION
UNAVAILABLE = sandbox_child.UNAVAILABLE


class SandboxUnavailable(Refused):
    """isolation required and this machine cannot give a layer (the message names it and why)."""


@dataclass(frozen=True)
class Limits:
    """From an rlhf.rewards entry (tasks/rlhf/config.py RewardConfig holds the defaults): none here."""
    timeout_s: float
    memory_mb: int
    isolation: str


# What the probe runs ("pass"): room enough to start Python, and a long wait on a loaded machine.
PROBE_LIMITS = Limits(timeout_s=30, memory_mb=512, isolation="limits_only")


@dataclass
class Outcome:
    passed: set[int]
    total: int
    timed_out: bool
    layers: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return len(self.passed) / self.total if self.total else 0.0


# ---- test cases: validated before anything runs ---------------------------------------------------------------------
def test_problem(test, index: int) -> str | None:
    if isinstance(test, str):
        if not test.strip():
            return f"test {index}: empty"
        try:
            compile(test, f"<test {index}>", "exec")
        except SyntaxError as e:
            return f"test {index}: not valid Python (line {e.lineno}: {e.msg})"
        return None
    if isinstance(test, dict):
        if set(test) != {"input", "output"} or not all(isinstance(test[k], str) for k in ("input", "output")):
            return (f"test {index}: an input/output test is an object with exactly the string fields input and "
                    f"output (got fields {sorted(test)})")
        return None
    return (f"test {index}: expected a string (Python statements, e.g. an assert) or an object {{input, output}}, "
            f"got {type(test).__name__}")


def tests_problem(tests) -> str | None:
    """Why a row's test cases cannot be run, or None."""
    if not isinstance(tests, list) or not tests:
        return f"expected a non-empty list of tests, got {type(tests).__name__ if tests != [] else 'an empty list'}"
    if len(tests) > MAX_TESTS:
        return f"{len(tests)} tests; at most {MAX_TESTS} per row"
    return next((p for i, t in enumerate(tests) if (p := test_problem(t, i))), None)


# ---- one run ----------------------------------------------------------------------------------------------------------
def child_env(folder: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}


def kill_group(proc: subprocess.Popen) -> None:
    """The child and everything still in its process group (a background process it started included)."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def read_lines(path: Path, nonce: str) -> list[tuple[str, str]]:
    """(what, value) of the result lines that carry the nonce."""
    try:
        with open(path, "rb") as f:
            text = f.read(RESULTS_READ).decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head == nonce:
            what, _, value = rest.partition(" ")
            out.append((what, value))
    return out


def read_results(lines: list[tuple[str, str]]) -> tuple[set[int], list[str], list[str]]:
    """(passed test indexes, layers, missing layers)."""
    passed, layers, missing = set(), [], []
    for what, value in lines:
        if what == "pass" and value.isdigit():
            passed.add(int(value))
        elif what in ("layers", "missing"):
            (layers if what == "layers" else missing).extend(json.loads(value))
    return passed, layers, missing


def child_job(code: str, tests: list, limits: Limits, nonce: str, as_tool: bool = False) -> dict:
    """The child's whole spec (its stdin): checked here and again by the child, with the same function."""
    job = {"memory_mb": limits.memory_mb, "cpu_s": math.ceil(limits.timeout_s) + 1, "isolation": limits.isolation,
           "code": code, "tests": tests, "nonce": nonce, "as_tool": as_tool}
    if problem := sandbox_child.job_problem(job):
        raise ValueError(f"sandbox: {problem}")
    return job


def run_child(job: dict, limits: Limits) -> tuple[list[tuple[str, str]], bool]:
    """One sandboxed child on the job (child_job's): (its result lines, whether it ran past the timeout). Raises
    SandboxUnavailable when isolation is required and a layer is missing here."""
    with tempfile.TemporaryDirectory(prefix="baton-sandbox-", ignore_cleanup_errors=True) as folder:
        proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], cwd=folder, env=child_env(folder),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        timed_out = False
        try:
            proc.communicate(json.dumps(job).encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)
        lines = read_lines(Path(folder) / "results", job["nonce"])
    _, _, missing = read_results(lines)
    if proc.returncode == UNAVAILABLE and missing and limits.isolation == "required":
        raise SandboxUnavailable("the code sandbox cannot isolate code on this machine: " + "; ".join(missing) +
                                 " (isolation: limits_only runs it with the limits alone)")
    return lines, timed_out


def run_tests(code: str, tests: list, limits: Limits) -> Outcome:
    """Run `code` against `tests` in the sandbox. Raises SandboxUnavailable when isolation is required and a layer
    is missing here."""
    lines, timed_out = run_child(child_job(code, tests, limits, secrets.token_hex(16)), limits)
    passed, layers, missing = read_results(lines)
    return Outcome({i for i in passed if i < len(tests)}, len(tests), timed_out, layers, missing)


@dataclass
class ToolRun:
    """The python tool's call (rlhf.tools): what the code printed, the exception it raised, or that it timed out."""

    printed: str
    raised: str | None
    timed_out: bool


def run_tool_code(code: str, limits: Limits) -> ToolRun:
    """Run `code` once as a program (no stdin) in the sandbox, keeping what it printed (rlhf.tools: python)."""
    lines, timed_out = run_child(child_job(code, [], limits, secrets.token_hex(16), as_tool=True), limits)
    found = {what: json.loads(value) for what, value in lines if what in ("printed", "raised")}
    if not timed_out and "printed" not in found:  # killed by a limit before it reported (memory, CPU)
        found["raised"] = "the code was stopped by a resource limit of the sandbox"
    return ToolRun(found.get("printed", ""), found.get("raised"), timed_out)


def probe() -> list[str]:
    """The isolation layers this machine cannot give ('layer: why'); empty when the sandbox is whole."""
    outcome = run_tests("", ["pass"], PROBE_LIMITS)
    if not outcome.layers and not outcome.missing:
        return ["sandbox: the child started but reported nothing (python -I tasks/rlhf/sandbox_child.py)"]
    return outcome.missing
