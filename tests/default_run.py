"""The README's first command, `baton run configs/tiny.yaml` (data → pretrain → convert → rlhf → finetune → convert →
serve on vLLM then SGLang), run once per test session on a pseudo-terminal against the local stack (`make up`), as a
person types it. Every test that only reads a finished run reads this one: the terminal view, lineage, runs/show,
verify of each format, the Prefect and MLflow pages. Shared through the session fixture below (imported by conftest).
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
RUN_TIMEOUT_S = 1800
_CSI = re.compile(r"\x1b\[(\??)([0-9;]*)([A-Za-z])")


def screen(raw: str) -> list[str]:
    """The lines left on a terminal after raw output (enough of a VT100 for rich's live redraws)."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(raw):
        m = _CSI.match(raw, i)
        if m:
            n = int(m.group(2) or 1) if m.group(2).isdigit() else 1
            if m.group(3) == "A":
                row = max(0, row - n)
            elif m.group(3) == "K":
                lines[row] = lines[row][:col] if m.group(2) in ("", "0") else ""
            i = m.end()
            continue
        ch = raw[i]
        i += 1
        if ch == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif ch == "\r":
            col = 0
        elif ch >= " ":
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def run_in_pty(args: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """The real CLI on a pseudo-terminal of an ordinary size (80×24), as a person at a terminal runs it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = dict(env, TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    while time.time() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = proc.wait(timeout=max(1, deadline - time.time()))
    return rc, b"".join(chunks).decode("utf-8", errors="replace")


@dataclass
class FinishedRun:
    rc: int
    raw: str            # everything the terminal received
    lines: list[str]    # what is left on the screen
    home: Path
    env: dict           # the client environment of the stack it ran against
    seconds: float
    run_dir: Path | None = None
    summary: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)      # label -> summary entry
    champion: str | None = None                     # the champion version right after the run

    def failure(self) -> str:
        return self.raw[-6000:]


@pytest.fixture(scope="session")
def default_run(ops_stack) -> FinishedRun:
    t0 = time.time()
    rc, raw = run_in_pty(["run", str(TINY)], ops_stack.env, timeout=RUN_TIMEOUT_S)
    lines = screen(raw)
    run = FinishedRun(rc, raw, lines, ops_stack.home, ops_stack.env, round(time.time() - t0, 1))
    print(f"default run: {run.seconds}s, exit {rc}, {len(lines)} lines on screen")
    last = Path(lines[-1].strip()) if lines else None
    if last is not None and (last / "summary.json").exists():
        run.run_dir = last
        run.summary = json.loads((last / "summary.json").read_text())
        run.stages = {s["label"]: s for s in run.summary["stages"]}
        try:
            run.champion = ops_stack.mlflow().get_model_version_by_alias("baton-tiny", "champion").version
        except Exception:  # noqa: BLE001 - no champion: the run's own test says why
            run.champion = None
    return run
