"""`--from hf:ORG/NAME[@REVISION]`: a Hugging Face hub model as the run's input.

huggingface_hub fetches the snapshot into its own cache (or, offline, finds it there); baton then links the snapshot's
files into `$BATON_HOME/hub/ORG--NAME/<commit>/` (hard links where possible, the cache itself stays untouched) and
writes a manifest there, so the model enters the chain like any checkpoint folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from conversions import hf, manifest as mf
from conversions.manifest import Format
from flows.config import ConfigError

PREFIX = "hf:"
ARCH_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")
WANTED = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def hf_manifest(path: Path, stage: str | None = None) -> dict:
    """The manifest of an HF folder made elsewhere: architecture from config.json, every file hashed."""
    config = json.loads((path / "config.json").read_text())
    arch = {k: v for k, v in config.items() if k in ARCH_KEYS}
    if moe := hf.moe_of_hf_config(config):  # in model.moe's names
        arch["moe"] = moe
    return mf.build(path, format=Format.HF_SAFETENSORS, stage=stage, architecture=arch,
                    parameter_count=hf.parameter_count(path), dtype=hf.dominant_dtype(path),
                    engine={"name": "external"}, tokenizer_dir=path)


def _snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo, revision=revision, allow_patterns=WANTED))
    except Exception as e:  # LocalEntryNotFoundError offline, connection errors, RepositoryNotFoundError, ...
        offline = constants.HF_HUB_OFFLINE
        why = ("offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local cache" if offline else
               "it could not be downloaded and is not in the local cache")
        raise ConfigError(f"--from {PREFIX}{repo}{'@' + revision if revision else ''}: {why} "
                          f"({constants.HF_HUB_CACHE}) [{type(e).__name__}]") from None


def _link_tree(src: Path, dst: Path) -> None:
    for f in src.rglob("*"):
        if f.is_dir():
            continue
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        real = f.resolve()  # cache snapshots are symlinks into blobs/
        try:
            os.link(real, target)
        except OSError:
            shutil.copy2(real, target)


def fetch(ref: str, home: Path) -> Path:
    """hf:ORG/NAME[@REV] → a checkpoint folder with a manifest (made once per commit)."""
    repo, _, revision = ref[len(PREFIX):].partition("@")
    if repo.count("/") != 1:
        raise ConfigError(f"--from {ref}: expected {PREFIX}ORG/NAME[@REVISION]")
    snap = _snapshot(repo, revision or None)
    if not (snap / "config.json").exists():
        raise ConfigError(f"--from {ref}: the snapshot {snap} has no config.json (not a transformers model)")
    dest = home / "hub" / repo.replace("/", "--") / snap.name
    if mf.read(dest) is not None:
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _link_tree(snap, tmp)
    mf.write(tmp, hf_manifest(tmp, stage="hub"))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest
