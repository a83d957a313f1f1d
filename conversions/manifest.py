"""The manifest written beside every checkpoint: what it is, which files make it up, where it came from."""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from . import durable

MANIFEST_NAME = "baton_manifest.json"
SCHEMA = "baton.manifest/1"

FORMATS = {
    "hf-safetensors": "Hugging Face transformers layout: config.json + *.safetensors + tokenizer",
    "megatron-dist": "megatron.core dist_checkpointing (torch_dist) of a GPTModel",
    "deepspeed-zero": "DeepSpeed engine.save_checkpoint folder (ZeRO partitions)",
    "dataset": "baton data stage output: datasets and tokenizer",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


class ManifestError(Exception):
    pass


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# The step's own log may sit beside the files a step writes (the data stage writes into its step folder); it grows
# while the step runs, so it is never part of what a manifest describes.
NOT_CONTENT = (MANIFEST_NAME, "step.log")


def list_files(root: Path) -> list[Path]:
    """Every regular file below root except the manifest and the step log, sorted, relative to root."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            rel = p.relative_to(root)
            if rel.as_posix() in NOT_CONTENT or p.is_symlink() or _manifest_tmp(rel):
                continue
            out.append(rel)
    return sorted(out, key=lambda p: p.as_posix())


def _manifest_tmp(rel: Path) -> bool:
    """A manifest write in flight (or cut short by a crash): not part of the checkpoint."""
    return len(rel.parts) == 1 and rel.name.startswith(f".{MANIFEST_NAME}.") and rel.name.endswith(".tmp")


def file_entries(root: Path, files: Iterable[Path] | None = None) -> list[dict]:
    root = Path(root)
    rels = list(files) if files is not None else list_files(root)
    return [{"path": r.as_posix(), "size": (root / r).stat().st_size, "sha256": sha256_file(root / r)} for r in rels]


def chat_template_present(root: Path) -> bool:
    root = Path(root)
    if (root / "chat_template.jinja").exists():
        return True
    cfg = root / "tokenizer_config.json"
    if cfg.exists():
        try:
            return bool(json.loads(cfg.read_text()).get("chat_template"))
        except json.JSONDecodeError:
            return False
    return False


def tokenizer_info(root: Path) -> dict:
    root = Path(root)
    return {"files": [f for f in TOKENIZER_FILES if (root / f).exists()], "chat_template": chat_template_present(root)}


def digest_of(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build(
    root: Path,
    *,
    format: str,
    stage: str | None,
    engine: dict | None = None,
    architecture: dict | None = None,
    parameter_count: int | None = None,
    dtype: str | None = None,
    parent: dict | None = None,
    extra: dict | None = None,
    tokenizer_dir: Path | None = None,
) -> dict:
    if format not in FORMATS:
        raise ManifestError(f"unknown checkpoint format {format!r}; known: {', '.join(FORMATS)}")
    root = Path(root)
    return {
        "schema": SCHEMA,
        "format": format,
        "stage": stage,
        "engine": engine or {},
        "architecture": architecture or {},
        "parameter_count": parameter_count,
        "dtype": dtype,
        "files": file_entries(root),
        "tokenizer": tokenizer_info(tokenizer_dir or root),
        "parent": parent,
        "extra": extra or {},
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write(root: Path, manifest: dict) -> Path:
    """Write atomically: a reader sees the old manifest or the whole new one."""
    return durable.write_json(Path(root) / MANIFEST_NAME, manifest, sort_keys=True)


def read(root: Path) -> dict | None:
    path = Path(root) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from e
    if m.get("schema") != SCHEMA:
        raise ManifestError(f"{path}: unknown manifest schema {m.get('schema')!r}")
    return m


def parent_ref(root: Path) -> dict | None:
    """The `parent` entry for a checkpoint derived from the one at root (None when root has no manifest)."""
    m = read(root)
    if m is None:
        return None
    return {"digest": digest_of(m), "path": str(Path(root).resolve()), "format": m["format"], "stage": m.get("stage")}


def engine_versions(*dists: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out
