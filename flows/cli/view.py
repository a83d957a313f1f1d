"""What `baton run` shows on the terminal: one line per step (status, elapsed, progress with ETA, latest loss).

On a terminal it is a rich live view; otherwise (CI, a file, a Prefect worker's log) one plain line per event, with no
control characters. Everything else the process writes (Prefect, MLflow, engines, tqdm, warnings) goes to the run's
`run.log`, and each step's log records to its own `step.log` (tasks/streaming.py).
"""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tasks import events, launch, streaming
from tasks.stage import Failure, Status, Why, reasons_text

FAILURE_TAIL_LINES = 30
_EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt)\b:?\s")
_MARKS = {Status.PENDING: "·", Status.RUNNING: "▶", Status.COMPLETED: "✓", Status.CACHED: "✓", Status.FAILED: "✗",
          Status.SKIPPED: "-", Status.CANCELLED: "■"}


@dataclass
class StepState:
    label: str
    status: str = Status.PENDING
    started: float | None = None
    ended: float | None = None
    step: int = 0
    total: int = 0
    progress_started: float | None = None
    loss: float | None = None
    log_path: Path | None = None
    entry: dict = field(default_factory=dict)

    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.time()) - self.started

    def eta(self) -> float | None:
        if not self.total or self.step <= 0 or self.progress_started is None or self.step >= self.total:
            return None
        rate = (time.time() - self.progress_started) / self.step
        return rate * (self.total - self.step)


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return ""
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class View:
    """The step states, updated by streaming's events; subclasses decide how they are drawn."""

    def __init__(self, labels: list[str], out: TextIO, title: str):
        self.out, self.title = out, title
        self.steps = {label: StepState(label) for label in labels}

    def _state(self, label: str) -> StepState:
        return self.steps.setdefault(label, StepState(label))

    def step_started(self, label: str, log_path: Path | None) -> None:
        st = self._state(label)
        st.status, st.started, st.log_path = Status.RUNNING, time.time(), log_path
        self.changed(st, "started")

    def step_progress(self, label: str, step: int, total: int) -> None:
        st = self._state(label)
        if st.progress_started is None:
            st.progress_started = time.time()
        st.step, st.total = step, total
        self.changed(st, "progress")

    def step_metric(self, label: str, step: int, values: dict) -> None:
        if events.TRAIN_LOSS in values:
            self._state(label).loss = values[events.TRAIN_LOSS]

    def step_finished(self, label: str, entry: dict, log_path: Path | None) -> None:
        st = self._state(label)
        st.status, st.entry, st.ended = entry.get("status", "?"), entry, time.time()
        st.started = st.started or st.ended
        st.log_path = log_path or st.log_path
        self.changed(st, "finished")

    def changed(self, st: StepState, what: str) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def describe(st: StepState) -> str:
    """The plain one-line description of a step: status, elapsed, progress, ETA, loss."""
    parts = [f"{st.label:<26}", f"{st.status:<9}", f"{fmt_seconds(st.elapsed()):>6}"]
    if st.total:
        parts.append(f"{st.step}/{st.total}")
        if st.status == Status.RUNNING and st.eta() is not None:
            parts.append(f"eta {fmt_seconds(st.eta())}")
    if st.loss is not None:
        parts.append(f"loss {st.loss:.4g}")
    if st.status == Status.FAILED and st.entry.get("error"):
        parts.append(st.entry["error"].splitlines()[0][:120])
    elif why := reran_because(st.entry):
        parts.append(why)
    return "  ".join(parts)


def reran_because(entry: dict) -> str:
    """'re-ran: code changed (tasks/rlhf/rewards.py)' for a step that ran although an earlier run of it completed;
    '' for a first run or a reused one (its status says `cached`)."""
    reasons = [r for r in entry.get("reason") or [] if r.get("why") not in (Why.NEW, Why.CACHED)]
    return f"re-ran: {reasons_text(reasons)}" if reasons else ""


class PlainView(View):
    """One line per event (started, every ~10% or 15 s of progress, finished); safe for files and CI logs."""

    def __init__(self, labels: list[str], out: TextIO, title: str):
        super().__init__(labels, out, title)
        self._last_print: dict[str, tuple[float, int]] = {}

    def start(self) -> None:
        self._line(self.title)

    def _line(self, text: str) -> None:
        self.out.write(time.strftime("%H:%M:%S ") + text + "\n")
        self.out.flush()

    def changed(self, st: StepState, what: str) -> None:
        if what == "progress":
            when, decile = self._last_print.get(st.label, (0.0, -1))
            now_decile = 10 * st.step // max(st.total, 1)
            if now_decile == decile and time.time() - when < 15 and st.step < st.total:
                return
            self._last_print[st.label] = (time.time(), now_decile)
        self._line(describe(st))


_GAP = 1
_BAR_MIN, _BAR_MAX = 8, 24
_LABEL_MIN = 8
_STYLES = {Status.RUNNING: "cyan", Status.COMPLETED: "green", Status.CACHED: "blue", Status.FAILED: "bold red",
           Status.CANCELLED: "yellow"}


def _row_fields(st: StepState) -> dict:
    """The words of a step's live row."""
    eta = st.eta() if st.status == Status.RUNNING else None
    return {"label": f"{_MARKS.get(st.status, '?')} {st.label}", "status": st.status,
            "elapsed": fmt_seconds(st.elapsed()) if st.started else "",
            "counts": f"{st.step}/{st.total}" if st.total else "",
            "eta": f"eta {fmt_seconds(eta)}" if eta is not None else "",
            "loss": f"loss {st.loss:.4g}" if st.loss is not None else ""}


def _field_widths(rows: list[dict], terminal_width: int) -> dict:
    """Column widths of the live rows, in display order. Status, elapsed, step/total, ETA and loss are always whole;
    the progress bar takes what is left (up to its usual width) and goes when too little is; the label is cut last."""
    whole = {name: max(len(r[name]) for r in rows) for name in ("status", "elapsed", "counts", "eta", "loss")}

    def used(columns: dict) -> int:
        shown = [w for w in columns.values() if w]
        return sum(shown) + _GAP * (len(shown) - 1)

    label = max(len(r["label"]) for r in rows)
    bar = min(_BAR_MAX, terminal_width - used({"label": label, **whole}) - _GAP)
    if bar < _BAR_MIN or not whole["counts"]:
        bar = 0
    label = max(_LABEL_MIN, min(label, terminal_width - used({**whole, "bar": bar}) - _GAP))
    widths = {"label": label, "status": whole["status"], "elapsed": whole["elapsed"], "bar": bar,
              "counts": whole["counts"], "eta": whole["eta"], "loss": whole["loss"]}
    return {name: w for name, w in widths.items() if w}


def _live_row(st: StepState, fields: dict, widths: dict):
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    style = _STYLES.get(st.status, "dim")
    line = Table.grid(padding=(0, _GAP))
    cells = []
    for name, width in widths.items():
        line.add_column(width=width, no_wrap=True, overflow="ellipsis", justify="right" if name == "elapsed" else "left")
        if name == "bar":
            cells.append(ProgressBar(total=st.total, completed=st.step, width=width) if st.total else Text(""))
        else:
            cells.append(Text(fields[name], style=style if name in ("label", "status") else ""))
    line.add_row(*cells)
    return line


class LiveView(View):
    """A rich live table redrawn a few times a second; the last frame stays on screen."""

    def __init__(self, labels: list[str], out: TextIO, title: str):
        super().__init__(labels, out, title)
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=out, force_terminal=True)
        self.live = Live(get_renderable=self._render, console=self.console, refresh_per_second=4,
                         redirect_stdout=False, redirect_stderr=False)

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        steps = list(self.steps.values())
        rows = [_row_fields(st) for st in steps]
        widths = _field_widths(rows, self.console.width)
        parts = [Text(self.title, style="bold", no_wrap=True, overflow="ellipsis")]
        parts += [_live_row(st, fields, widths) for st, fields in zip(steps, rows)]
        if all(st.status == Status.PENDING for st in steps):
            parts.append(Text("starting Prefect and MLflow …", style="dim"))
        return Group(*parts)

    def start(self) -> None:
        self.live.start()

    def stop(self) -> None:
        self.live.refresh()
        self.live.stop()


def detach_process_output(log_path: Path) -> TextIO:
    """Send this process's stdout and stderr (file descriptors, so native libraries and subprocesses too) to log_path
    for the rest of its life; return a stream to the original stdout for the view."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import logging

    logging.captureWarnings(True)  # a library's warnings go to the logs, not the terminal
    _plain_prefect_console()
    return terminal


def _plain_prefect_console() -> None:
    """Prefect's console handler chose colours when stderr was still a terminal; its lines now go to a file."""
    import logging

    from rich.console import Console

    for name in (None, "uvicorn", "fastapi"):
        for handler in logging.getLogger(name).handlers:
            if hasattr(handler, "console") and hasattr(handler, "stream"):
                handler.console = Console(file=handler.stream, color_system=None, highlight=False, markup=False,
                                          width=200)


def open_view(labels: list[str], title: str, out: TextIO, live: bool = True) -> View:
    """A live view on a terminal (unless the logs stream there too), plain lines otherwise."""
    cls = LiveView if live and out.isatty() and os.environ.get("TERM") != "dumb" else PlainView
    view = cls(labels, out, title)
    streaming.observe(view)
    view.start()
    return view


def close_view(view: View) -> None:
    streaming.observe(None)
    view.stop()


def failure_cause(entry: dict, tail: list[str]) -> str:
    """One line: the step's error, with the last exception line of its log when that says more."""
    error = (entry.get("error") or "failed").splitlines()[0]
    raised = [line for line in tail if _EXCEPTION_LINE.search(line)]
    if raised:
        last = raised[-1].strip()
        if last not in error and error not in last:
            error = f"{error} — {last[-200:]}"
    return error


def failure_report(entry: dict) -> list[str]:
    """The failing step and its cause in one line; then, by the kind of failure, the checks a gate refused, or the last
    lines of the log (an engine's failure or a bug); and the log's path. A refused input is its one line: the message
    names the file, line or key, and baton's own frames would only hide it."""
    log_path = Path(entry["log"]) if entry.get("log") else None
    label = entry.get("label", entry.get("name"))
    if entry.get("failure") in (Failure.REFUSED, Failure.NO_ROOM, Failure.GATE):
        lines = [f"✗ {label} failed: {(entry.get('error') or 'failed').splitlines()[0]}"]
        if entry.get("failure") == Failure.GATE:
            lines += [f"  ✗ {c['name']}: {c.get('detail', '')}" for c in (entry.get("gate") or {}).get("checks", [])
                      if not c.get("passed")]
        return lines + ([f"--- log: {log_path}"] if log_path else [])
    tail = launch.without_library_frames(streaming.tail(log_path, 4 * FAILURE_TAIL_LINES))[-FAILURE_TAIL_LINES:]
    lines = [f"✗ {label} failed: {failure_cause(entry, tail)}"]
    if tail:
        lines.append(f"--- last {len(tail)} lines of {log_path} (library traceback frames left out) ---")
        lines += tail
        lines.append(f"--- full log: {log_path}")
    return lines


def summary_lines(summary: dict, width: int | None = None) -> list[str]:
    """The end-of-run table: step, status, time, gate, key numbers, and why a step re-ran. Where a row would be wider
    than the terminal, its key numbers go on the next line, indented, instead of wrapping."""
    stages = summary.get("stages", [])
    label_width = max([len(s["label"]) for s in stages] + [5])
    rows = []
    for s in stages:
        gate = s.get("gate") or {}
        checks = gate.get("checks") or []
        g = f"gate {sum(c['passed'] for c in checks)}/{len(checks)}" if checks else ""
        secs = fmt_seconds(s["seconds"]) if isinstance(s.get("seconds"), (int, float)) else ""
        row = f"  {s['label']:<{label_width}} {s['status']:<9} {secs:>6}  {g:<10}".rstrip()
        key = "  ".join(k for k in (_key_numbers(s), reran_because(s)) if k)
        if key and width and len(row) + 2 + len(key) > width:
            rows += [row, f"{'':<{label_width + 4}}{key}"]
        else:
            rows.append(f"{row:<{label_width + 31}} {key}".rstrip() if key else row)
    return rows


def _key_numbers(s: dict) -> str:
    m = s.get("metrics") or {}
    key = f"loss {m['loss_first']:.3g} → {m['loss_last']:.3g}" if "loss_first" in m and "loss_last" in m else ""
    ev = s.get("eval") or {}
    if isinstance(ev.get("before"), (int, float)) and isinstance(ev.get("after"), (int, float)):
        key = (key + "  " if key else "") + f"{ev.get('metric')} {ev['before']:.3g} → {ev['after']:.3g}"
    return key
