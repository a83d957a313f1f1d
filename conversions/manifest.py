"""The manifest written beside every checkpoint: what it is, which files make it up, where it came from."""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable

from . import durable, folder
from .refusal import Refused

MANIFEST_NAME = "baton_manifest.json"
SCHEMA = "baton.manifest/1"


class Format(StrEnum):
    """What a folder baton wrote holds: its manifest's `format`. The values are written into manifests, plans and
    MLflow tags that existing checkpoints carry, so they never change; this class is their only home in the code."""
    HF_SAFETENSORS = "hf-safetensors"
    MEGATRON_DIST = "megatron-dist"
    DEEPSPEED_ZERO = "deepspeed-zero"
    DATASET = "dataset"
    GGUF_FILE = "gguf-file"
    COMPRESSED_TENSORS = "hf-compressed-tensors"


FORMATS = {
    Format.HF_SAFETENSORS: "Hugging Face transformers layout: config.json + *.safetensors + tokenizer",
    Format.MEGATRON_DIST: "megatron.core dist_checkpointing (torch_dist) of a GPTModel",
    Format.DEEPSPEED_ZERO: "DeepSpeed engine.save_checkpoint folder (ZeRO partitions)",
    Format.DATASET: "baton data stage output: datasets and tokenizer",
    Format.GGUF_FILE: "`baton export` output: one llama.cpp GGUF file (model.gguf), gated against its HF parent",
    Format.COMPRESSED_TENSORS: "`baton export --type w8a8|w4a16` output: an HF folder whose weights llm-compressor "
                               "quantized (compressed-tensors) for vLLM, gated against its HF parent",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


class ManifestError(Refused):
    pass


CHUNK = 8 << 20
# Digests computed by this process, keyed by what any write to the file changes (inode, size, mtime and ctime in ns).
# An entry is kept only for a file whose last change is clearly older than the start of its hashing, so a write racing
# the hash (or landing within the file system's coarse clock tick after it) can never leave a stale entry behind.
_DIGESTS: dict[tuple, str] = {}
_RACY_NS = 50_000_000
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_stream(path: Path) -> str:
    """sha256 of the file, read into one reused buffer (hashlib releases the GIL: threads hash files in parallel)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# The step's own log may sit beside the files a step writes (the data stage writes into its step folder); it grows
# while the step runs, so it is never part of what a manifest describes.
NOT_CONTENT = (MANIFEST_NAME, "step.log")
def sha256_file(path: Path, chunk: int | None = None, *, reuse: bool = True) -> str:
    """sha256 of a file. reuse: skip re-reading a file this process already hashed and that has not changed since."""
    st = os.stat(path)
    key = _stat_key(st)
    if reuse and key in _DIGESTS:
        return _DIGESTS[key]
    started = time.time_ns()
    digest = _hash_stream(Path(path))
    if max(st.st_mtime_ns, st.st_ctime_ns) < started - _RACY_NS and _stat_key(os.stat(path)) == key:
        _DIGESTS[key] = digest
    return digest


def sha256_files(paths: Iterable[Path], *, reuse: bool = True, threads: int | None = None) -> list[str]:
    """sha256_file over many files at once, largest first over a few threads (in the order given)."""
    paths = [Path(p) for p in paths]
    workers = min(threads or HASH_THREADS, len(paths)) or 1
    if workers == 1:
        return [sha256_file(p, reuse=reuse) for p in paths]
    order = sorted(range(len(paths)), key=lambda i: -os.stat(paths[i]).st_size)
    with ThreadPoolExecutor(workers) as pool:
        digests = dict(zip(order, pool.map(lambda i: sha256_file(paths[i], reuse=reuse), order)))
    return [digests[i] for i in range(len(paths))]


def list_files(root: Path) -> list[Path]:
    """Every regular file below root except the manifest and the step log, sorted, relative to root. ManifestError
    naming them when root holds anything but directories and regular files (a symlink, a device, a FIFO): a manifest
    never describes a folder whose readers could be led outside it."""
    try:
        folder.refuse_unsafe(root)
    except folder.UnsafeEntryError as e:
        raise ManifestError(str(e)) from e
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = Path(dirpath, n).relative_to(root)
            if rel.as_posix() in NOT_CONTENT or _manifest_tmp(rel):
                continue
            out.append(rel)
    return sorted(out, key=lambda p: p.as_posix())


def _manifest_tmp(rel: Path) -> bool:
    """A manifest write in flight (or cut short by a crash): not part of the checkpoint."""
    return len(rel.parts) == 1 and rel.name.startswith(f".{MANIFEST_NAME}.") and rel.name.endswith(".tmp")


def file_entries(root: Path, files: Iterable[Path] | None = None) -> list[dict]:
    root = Path(root)
    rels = list(files) if files is not None else list_files(root)
    digests = sha256_files(root / r for r in rels)
    return [{"path": r.as_posix(), "size": (root / r).stat().st_size, "sha256": d} for r, d in zip(rels, digests)]


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


# ---- the serving contract: what a server needs besides the weights to answer as the model was trained -----------
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")


def _json_file(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _text_sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def _chat_template_text(tok_dir: Path) -> str | None:
    if (tok_dir / "chat_template.jinja").exists():
        return (tok_dir / "chat_template.jinja").read_text()
    template = _json_file(tok_dir / "tokenizer_config.json").get("chat_template")
    return template if isinstance(template, str) or not template else json.dumps(template, sort_keys=True)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def serving_contract(root: Path, tokenizer_dir: Path | None = None) -> dict:
    """Tokenizer and chat template digests, special tokens and ids, stop tokens and generation defaults: what a
    server reads beside the weights. A field the folder does not have is None."""
    root, tok_dir = Path(root), Path(tokenizer_dir or root)
    vocab = [f for f in VOCABULARY_FILES if (tok_dir / f).exists()]
    tok_cfg = _json_file(tok_dir / "tokenizer_config.json")
    config = _json_file(root / "config.json")
    generation = {k: v for k, v in _json_file(root / "generation_config.json").items() if k != "transformers_version"}
    stop = generation.get("eos_token_id", config.get("eos_token_id"))
    return {
        "tokenizer_sha256": _text_sha256("".join(f"{f}:{sha256_file(tok_dir / f)}\n" for f in vocab)) if vocab else None,
        "chat_template_sha256": _text_sha256(_chat_template_text(tok_dir)),
        "special_tokens": {k: _token_text(tok_cfg.get(k)) for k in SPECIAL_TOKENS},
        "token_ids": {k: config.get(f"{k}_id") for k in SPECIAL_TOKENS},
        "stop_token_ids": sorted(stop) if isinstance(stop, list) else ([stop] if stop is not None else None),
        "generation_config": generation or None,
    }


def serving_changes(before: dict | None, after: dict | None) -> list[str]:
    """The serving-contract fields that differ between a checkpoint's parent and itself ('field: old → new'); a field
    either side does not record is not compared."""
    if not before or not after:
        return []
    changes = []
    for key in sorted(set(before) & set(after)):
        old, new = before[key], after[key]
        if key == "generation_config" and isinstance(old, dict) and isinstance(new, dict):  # a default added counts
            changes += [f"{key}.{k}: {old.get(k)!r} → {new.get(k)!r}" for k in sorted(set(old) | set(new))
                        if old.get(k) != new.get(k)]
        elif isinstance(old, dict) and isinstance(new, dict):
            changes += [f"{key}.{k}: {old[k]!r} → {new[k]!r}" for k in sorted(set(old) & set(new))
                        if old[k] is not None and new[k] is not None and old[k] != new[k]]
        elif old is not None and new is not None and old != new:
            changes.append(f"{key}: {old!r} → {new!r}")
    return changes


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
        "format": Format(format).value,  # plain str: the manifest in memory is what a later read gives back
        "stage": stage,
        "engine": engine or {},
        "architecture": architecture or {},
        "parameter_count": parameter_count,
        "dtype": dtype,
        "files": file_entries(root),
        "tokenizer": tokenizer_info(tokenizer_dir or root),
        "serving": serving_contract(root, tokenizer_dir),
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
    except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors; RecursionError: nested deeper than json goes
        raise ManifestError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise ManifestError(f"{path}: unknown manifest schema {m.get('schema') if isinstance(m, dict) else m!r:.80}")
    bad = _bad_file_entry(m.get("files"))
    if bad is not None:
        raise ManifestError(f"{path}: files: {bad}")
    return m


_FILE_ENTRY = {"path": str, "size": int, "sha256": str}


def _bad_file_entry(files) -> str | None:
    """What is wrong with a manifest's `files` (None when each entry has a str path, an int size and a str sha256)."""
    if not isinstance(files, list):
        return "not a list"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return f"entry {i} is not an object"
        for key, kind in _FILE_ENTRY.items():
            if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
                return f"entry {i}: {key} must be a {kind.__name__}"
    return None


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
