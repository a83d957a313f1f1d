"""`baton import gguf:PATH DEST` and `--from gguf:PATH`: a GGUF file (llama.cpp's format) made into an HF safetensors
checkpoint folder by baton, with a manifest that records the source file's sha256 and header beside the usual
architecture and serving contract (tokenizer and chat template digests, bos/eos/pad ids)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from conversions import durable, gguf, manifest as mf
from flows import hub

PREFIX = "gguf:"


def source_path(ref: str) -> Path:
    if not ref.startswith(PREFIX) or not ref[len(PREFIX):]:
        raise gguf.GGUFError(f"{ref}: expected {PREFIX}PATH (a .gguf file)")
    return Path(ref[len(PREFIX):]).expanduser()


def import_gguf(src: Path, dest: Path) -> dict:
    """Import src into dest (which must not exist): private hashed copy, structure check, dequantise, manifest,
    then publish (tmp + fsync + rename). Returns the manifest."""
    dest = Path(dest).resolve()
    if dest.exists():
        raise gguf.GGUFError(f"{dest} exists (nothing is overwritten)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = durable.partial_of(dest)
    shutil.rmtree(partial, ignore_errors=True)  # a crashed earlier attempt's leftovers: never published
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".gguf-import-") as work:
        source = gguf.private_copy(src, Path(work))
        if problem := durable.free_space_problem(dest.parent, source.size * 6):  # fp32 from ~4.5 bits a weight
            raise gguf.GGUFError(f"{src}: {problem}; nothing written")
        gguf.check_structure(source, Path(work) / "model.gguf")
        try:
            gguf.to_hf(source, Path(work) / "model.gguf", partial)
            manifest = _manifest(partial, source)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    mf.write(partial, manifest)
    durable.publish_dir(partial, dest)
    return manifest


def _manifest(root: Path, source: gguf.Source) -> dict:
    m = hub.hf_manifest(root, stage="import")
    m["engine"] = {"name": "baton-import", **mf.engine_versions("transformers", "gguf")}
    m["extra"] = {"source": source.describe()}
    return m


def fetch(ref: str, home: Path) -> Path:
    """gguf:PATH → $BATON_HOME/imports/<name>-<sha256[:16]>/, imported once per distinct file content."""
    src = source_path(ref)
    digest = mf.sha256_file(src) if src.is_file() else None
    if digest is None:
        raise gguf.GGUFError(f"{ref}: no such file")
    dest = home / "imports" / f"{src.stem}-{digest[:16]}"
    existing = mf.read(dest) if dest.is_dir() else None
    if existing and existing.get("extra", {}).get("source", {}).get("sha256") == digest:
        return dest
    shutil.rmtree(dest, ignore_errors=True)  # an import of other bytes under this name: not what was asked
    if import_gguf(src, dest)["extra"]["source"]["sha256"] != digest:
        shutil.rmtree(dest, ignore_errors=True)
        raise gguf.GGUFError(f"{ref}: the file changed while it was imported; nothing kept")
    return dest
