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
