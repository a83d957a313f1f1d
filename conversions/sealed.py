"""A training checkpoint folder counts once its seal is written: one small JSON, written last and atomically, holding
the facts of the save and every file's size and sha256. Sizes make the cheap "did the save finish" check; a resume
reads the bytes again and compares the digests (a flipped bit, a torn copy, a file replaced since) before it trusts
the folder. Pretrain (Megatron), rlhf (TRL) and finetune (DeepSpeed) seal their checkpoints the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

from conversions import durable, manifest as mf


def _content(folder: Path, marker: str) -> list[Path]:
    """Every file below folder but the seal and its tmp files (`.<marker>.*.tmp`)."""
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and marker not in f.name]


def seal(folder: Path, marker: str, **facts) -> dict:
    """Write folder/marker with facts, sizes and sha256 of what is on disk now (call after the files are fsynced)."""
    files = _content(folder, marker)
    names = [f.relative_to(folder).as_posix() for f in files]
    body = {**facts, "files": {n: f.stat().st_size for n, f in zip(names, files)},
            "sha256": dict(zip(names, mf.sha256_files(files)))}
    durable.write_json(folder / marker, body)
    return body


def read(folder: Path, marker: str) -> dict | None:
    try:
        body = json.loads((folder / marker).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def is_sealed(folder: Path, marker: str) -> bool:
    """The save finished: the seal exists and every file it lists is there with its size (no content read)."""
    body = read(folder, marker)
    sizes = (body or {}).get("files") or {}
    return bool(sizes) and all((folder / n).is_file() and (folder / n).stat().st_size == s for n, s in sizes.items())


def problem(folder: Path, marker: str) -> str | None:
    """Why this folder's contents are not what its seal recorded (None when every file's sha256 matches)."""
    body = read(folder, marker)
    if body is None:
        return f"no {marker} (the save did not finish)"
    hashes = body.get("sha256")
    if not hashes:
        return "no sha256 recorded at save time"
    missing = [n for n in hashes if not (folder / n).is_file()]
    if missing:
        return f"{missing[0]} is missing"
    names = list(hashes)
    actual = mf.sha256_files([folder / n for n in names], reuse=False)  # read the bytes, whatever the stat says
    changed = [n for n, h in zip(names, actual) if h != hashes[n]]
    return f"{changed[0]} differs from the sha256 recorded at save time" if changed else None
