"""Run folders, the step index (what completed where) and summary.json."""
from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
from pathlib import Path

from tasks.tracking import baton_home


def runs_root() -> Path:
    return baton_home() / "runs"


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Index:
    """fingerprint → {status, work_dir, output, entry}: lets a later run reuse or resume a step."""

    def __init__(self, root: Path | None = None):
        self.root = (root or baton_home()) / "index"

    def get(self, fp: str) -> dict | None:
        p = self.root / f"{fp}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def put(self, fp: str, **record) -> None:
        _atomic_json(self.root / f"{fp}.json", {"fingerprint": fp, **record})


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = run_dir / "summary.json"
    _atomic_json(path, summary)
    return path


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


_STATUS = {"completed": "ok", "cached": "cached", "failed": "FAILED", "skipped": "skipped", "running": "running"}


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
