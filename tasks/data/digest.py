"""What the data step's fingerprint sees of local files: every matched file's path and sha256.

sha256 is recomputed only when a file's size or mtime changed since it was last hashed (a cache in
$BATON_HOME/file_digests.json, written atomically), so planning a run over large unchanged files stays cheap.
"""
from __future__ import annotations

import json
from pathlib import Path

from conversions import durable
from conversions.manifest import sha256_file
from tasks.data.config import DATASETS, DataConfig
from tasks.data.sources import matched_files


def _cache_path() -> Path:
    from tasks.tracking import baton_home

    return baton_home() / "file_digests.json"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _save(path: Path, cache: dict) -> None:
    try:
        durable.write_json(path, cache)
    except OSError:
        pass  # a read-only home only costs the next plan a re-hash


def patterns(cfg: DataConfig) -> list[str]:
    """Every train/heldout pattern of every files source (each source of a mixed list too)."""
    return [p for kind in DATASETS for _, src in cfg.sources(kind) if src.kind == "files"
            for p in (src.train, src.heldout) if p]


def file_digests(cfg: DataConfig) -> list[list[str]]:
    """[[resolved path, sha256]] of every file the data sources match, in a stable order."""
    cache_file = _cache_path()
    cache = _load(cache_file)
    out, changed = [], False
    for pattern in patterns(cfg):
        for f in matched_files(pattern):
            path = str(f.resolve())
            st = f.stat()
            hit = cache.get(path)
            if not hit or hit["size"] != st.st_size or hit["mtime_ns"] != st.st_mtime_ns:
                hit = cache[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(f)}
                changed = True
            out.append([path, hit["sha256"]])
    if changed:
        _save(cache_file, cache)
    return out
