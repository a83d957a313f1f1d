"""What a person sees from `baton run`: a calm view on a terminal and in a file, full logs in the step folders, and a
failing step's cause and log tail."""
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
from pathlib import Path

import pytest

from conftest import REPO, TINY, baton

pytestmark = pytest.mark.slow

STAGES = "data,pretrain,convert"
NOISE = ("@@baton", "LOAD_GLOBAL", "RETURN_VALUE", "Warning", "it/s]", "Traceback")
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


def run_in_pty(args: list[str], home: Path, timeout: float) -> tuple[int, str]:
    """The real CLI on a pseudo-terminal (120 columns), as a person at a terminal runs it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, BATON_HOME=str(home), TERM="xterm-256color")
    env.pop("MLFLOW_TRACKING_URI", None)
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


def _assert_calm(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert len(lines) < 60, text
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in the default view:\n{text}"


def _assert_step_logs(run_dir: Path) -> None:
    logs = {p.parent.name: p.read_text() for p in run_dir.glob("*/step.log")}
    assert set(logs) == {"00-data", "01-pretrain", "02-convert-megatron-to-hf"}, sorted(logs)
    assert "[pretrain] step 20: held-out loss" in logs["01-pretrain"]
    assert "gate L2.logits_parity [ok]" in logs["02-convert-megatron-to-hf"]
    assert "Beginning flow run" in (run_dir / "run.log").read_text()  # Prefect's own lines: in the run log


@pytest.fixture(scope="module")
def tty_run(tmp_path_factory):
    """One tiny data → pretrain → convert run on a pseudo-terminal, shared by the view and lineage tests."""
    home = tmp_path_factory.mktemp("tty") / "home"
    t0 = time.time()
    rc, raw = run_in_pty(["run", str(TINY), "--stages", STAGES], home, timeout=1500)
    lines = screen(raw)
    print(f"tty run: {time.time() - t0:.0f}s, {len(lines)} lines on screen")
    return rc, raw, lines, home


def test_terminal_shows_one_line_per_step_and_logs_go_to_files(tty_run):
    rc, raw, lines, _ = tty_run
    assert rc == 0, raw[-5000:]
    _assert_calm(lines)
    text = "\n".join(lines)
    assert re.search(r"pretrain\s+completed", text) and "60/60" in text and "loss" in text, text
    run_dir = Path(lines[-1].strip())
    assert run_dir.is_dir(), text
    _assert_step_logs(run_dir)


def test_lineage_names_every_step_back_to_the_data_digest(tty_run, monkeypatch):
    rc, raw, lines, home = tty_run
    assert rc == 0, raw[-5000:]
    run_dir = Path(lines[-1].strip())
    summary = json.loads((run_dir / "summary.json").read_text())
    by_label = {s["label"]: s for s in summary["stages"]}
    hf = by_label["convert-megatron-to-hf"]
    from flows.stages import data_digest

    digest = data_digest(by_label["data"]["output"])
    for ref in ("baton-tiny@candidate", f"baton-tiny/{hf['registered']['version']}", run_dir.name, hf["output"]):
        r = baton("lineage", ref, "--json", home=home, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        nodes = json.loads(r.stdout)
        assert [n["label"] for n in nodes] == ["data", "pretrain", "convert-megatron-to-hf"], ref
        assert nodes[0]["digest"] == digest
        assert [n.get("mlflow_run_id") for n in nodes] == [by_label[n["label"]]["mlflow_run_id"] for n in nodes]
        assert [n.get("prefect_flow_run_id") for n in nodes] == [by_label[n["label"]]["prefect_flow_run_id"]
                                                                 for n in nodes]
        assert nodes[1]["engine"].startswith("megatron-core") and nodes[2]["gate"].startswith("passed")
    text = baton("lineage", "baton-tiny@candidate", home=home, timeout=300).stdout
    assert digest[:12] in text and "↓ convert-megatron-to-hf" in text
    md = (run_dir / "summary.md").read_text()
    assert "```mermaid\nflowchart LR" in md and f"digest {digest[:12]}" in md
    from tasks import tracking

    monkeypatch.setenv("BATON_HOME", str(home))  # the registry of that run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    c = tracking.client()
    mv = c.get_model_version("baton-tiny", hf["registered"]["version"])
    assert "L2.logits_parity" in mv.description and "flowchart LR" in mv.description and digest in mv.description
    assert c.get_experiment_by_name("baton").tags[tracking.EXPERIMENT_KIND] == "custom_model_development"


def test_file_output_is_plain_and_a_failure_shows_cause_and_tail(tmp_path):
    r = baton("run", str(TINY), "--stages", STAGES, "--set", "pretrain.steps=20", "--set", "pretrain.checkpoint_every=10",
              "--set", "pretrain.eval_interval=10", home=tmp_path / "ok", timeout=1500)
    assert r.returncode == 0, r.stdout[-5000:]
    assert "\x1b" not in r.stdout and "\r" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    _assert_calm(lines)
    assert any(re.search(r"pretrain\s+running.*20/20", line) for line in lines), r.stdout
    # a config that validates but whose engine fails at run time: pretrain is killed by its own timeout
    bad = baton("run", str(TINY), "--stages", "data,pretrain", "--set", "pretrain.timeout_s=4",
                home=tmp_path / "bad", timeout=900)
    assert bad.returncode == 1, bad.stdout[-5000:]
    out = bad.stdout
    assert "✗ pretrain failed: pretrain timed out after 4.0s" in out, out
    log = Path(re.search(r"--- full log: (\S+)", out).group(1))
    assert log.name == "step.log" and log.parent.name == "01-pretrain"
    assert "exceeded its timeout" in log.read_text()
    tail = out.split(f"of {log} (library traceback frames left out) ---\n", 1)[1].split("--- full log:", 1)[0]
    tail = tail.splitlines()
    logged = log.read_text().splitlines()
    assert 0 < len(tail) <= 30 and tail[-1] == logged[-1] and set(tail) <= set(logged)
    assert "site-packages" not in "\n".join(tail)
    assert out.splitlines()[-1].endswith(log.parent.parent.name)
