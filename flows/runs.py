"""Run folders, the step index (what completed where), the per-step locks and summary.json."""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path

import filelock
import psutil

from conversions import durable
from tasks.paths import plain_name
from tasks.tracking import baton_home
from tasks.stage import Status

log = logging.getLogger("baton.runs")


def runs_root() -> Path:
    return baton_home() / "runs"


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class Index:
    """fingerprint → {status, work_dir, output, entry}: lets a later run reuse or resume a step."""

    def __init__(self, root: Path | None = None):
        self.root = (root or baton_home()) / "index"

    def get(self, fp: str) -> dict | None:
        """The record, or None when there is none or it cannot be read (a torn write must not stop later runs)."""
        p = self.root / f"{fp}.json"
        try:
            rec = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable index record (%s); treating the step as never run", p, e)
            return None
        return rec if isinstance(rec, dict) else None

    def put(self, fp: str, **record) -> None:
        durable.write_text(self.root / f"{fp}.json",
                           json.dumps({"fingerprint": fp, **record}, indent=2, default=str) + "\n")

    def _last_path(self, config: str, label: str) -> Path:
        return self.root / "last" / plain_name(config) / f"{plain_name(label)}.json"

    def last(self, config: str, label: str) -> dict | None:
        """{fingerprint, facts} of the last completed (or reused) run of step `label` under config name `config`:
        what a new run of it is compared with to say why it runs."""
        try:
            rec = json.loads(self._last_path(config, label).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def put_last(self, config: str, label: str, fp: str, facts: dict) -> None:
        durable.write_text(self._last_path(config, label),
                           json.dumps({"fingerprint": fp, "facts": facts}, indent=2, default=str) + "\n")


class StepBusy(RuntimeError):
    """Another live process runs this step (raised with --no-wait)."""


class StepLock:
    """One process at a time per step fingerprint. The OS drops the lock when its owner dies, so a crashed owner's
    lock is taken over and a live owner's never is; the owner file says who holds it (pid, host, start time)."""

    def __init__(self, fp: str, label: str = "", root: Path | None = None):
        folder = (root or baton_home()) / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        self.label = label or fp[:12]
        self.owner_file = folder / f"{fp}.owner.json"
        self._lock = filelock.FileLock(str(folder / f"{fp}.lock"))
        self.dead_owner: dict | None = None  # set by acquire: the owner that died holding the lock, if one did

    def owner(self) -> dict:
        try:
            return json.loads(self.owner_file.read_text())
        except (OSError, ValueError):
            return {}

    def describe_owner(self) -> str:
        o = self.owner()
        if not o:
            return "an unknown process"
        return f"pid {o.get('pid')} on {o.get('host')} (since {o.get('started')}, run {o.get('run_id')})"

    def holder(self) -> str | None:
        """Who holds this step now, or None when it is free; takes nothing (a probe before a run starts)."""
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            return self.describe_owner()
        self._lock.release()
        return None

    def acquire(self, run_id: str, wait: bool = True, poll_s: float = 2.0, report_every_s: float = 60.0) -> "StepLock":
        waited, last_report = 0.0, -report_every_s
        while True:
            try:
                self._lock.acquire(timeout=0)
                break
            except filelock.Timeout:
                if not wait:
                    raise StepBusy(f"step {self.label} is being run by {self.describe_owner()}; "
                                   "not waiting (--no-wait)") from None
                if waited - last_report >= report_every_s:
                    log.warning("step %s is being run by %s; waiting for it to finish", self.label,
                                self.describe_owner())
                    last_report = waited
                time.sleep(poll_s)
                waited += poll_s
        # an owner file outlives its owner only when the owner died holding the lock (release removes it first)
        self.dead_owner = self.owner() or None
        started = psutil.Process().create_time()
        durable.write_json(self.owner_file, {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
                                             "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
                                             "pid_create_time": started})
        return self

    def release(self) -> None:
        self.owner_file.unlink(missing_ok=True)
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def write_summary(run_dir: Path, summary: dict) -> Path:
    return durable.write_text(run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")


def list_runs(limit: int = 20) -> list[dict]:
    root = runs_root()
    if not root.exists():
        return []
    out = []
    for d in sorted(root.iterdir(), reverse=True)[:limit]:
        s = d / "summary.json"
        if s.exists():
            try:
                out.append(json.loads(s.read_text()) | {"run_dir": str(d)})
            except json.JSONDecodeError:
                continue
    return out


def _age(run_id: str) -> str:
    try:
        started = _dt.datetime.strptime(run_id[:15], "%Y%m%d-%H%M%S")
    except ValueError:
        return "?"
    s = int((_dt.datetime.now() - started).total_seconds())
    return f"{s // 86400}d" if s >= 86400 else f"{s // 3600}h" if s >= 3600 else f"{s // 60}m" if s >= 60 else f"{s}s"


_STATUS = {Status.COMPLETED: "ok", Status.CACHED: "cached", Status.FAILED: "FAILED", Status.SKIPPED: "skipped",
           Status.RUNNING: "running", Status.CANCELLED: "cancelled", Status.CRASHED: "CRASHED"}


def runs_table(rows: list[dict], champions: set[str]) -> str:
    """Plain columns: run, config, status, each step's status, champion marker (*), age."""
    lines = [f"{'run':<22} {'config':<10} {'status':<9} {'age':>4}  steps"]
    for r in rows:
        run = r["run_id"] + ("*" if r["run_id"] in champions else "")
        steps = "  ".join(f"{s['label']}:{_STATUS.get(s['status'], s['status'])}" for s in r.get("stages", []))
        lines.append(f"{run:<22} {r.get('config', '?'):<10} {r.get('status', '?'):<9} "
                     f"{_age(r['run_id']):>4}  {steps}")
    if champions & {r["run_id"] for r in rows}:
        lines.append("* its checkpoint is a registered model's champion")
    return "\n".join(lines)
