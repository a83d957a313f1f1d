"""`--from hf:ORG/NAME[@REVISION]` offline: a local Hugging Face cache that the test populates in huggingface_hub's own
layout (blobs/, snapshots/<commit>/ links, refs/main) is used; an empty cache gives one message. A model without a chat
template is refused before anything launches, with the fix. No engine starts."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import TINY, baton

pytestmark = pytest.mark.slow  # starts the CLI several times (seconds each)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_model(dest: Path, tokenizer_dir: Path, chat_template: bool = True) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not chat_template:
        tok.chat_template = None
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
                     ).save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    (dest / "chat_template.jinja").unlink(missing_ok=True) if not chat_template else None
    return dest


def populate_cache(cache: Path, repo: str, model: Path) -> None:
    """huggingface_hub's cache layout: models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> → blob, refs/main}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in model.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tasks.data.tokenizer import train_tokenizer

    train_tokenizer(["the answer is yes", "hello there"] * 20, 300, tmp_path / "tok")
    return tmp_path / "tok"


def test_hub_model_from_the_local_cache_offline_and_an_empty_cache(tmp_path, baton_home, tokenizer_dir):
    cache = tmp_path / "hf-cache"
    populate_cache(cache, "someorg/tiny-qwen", tiny_model(tmp_path / "model", tokenizer_dir))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    r = baton("config", str(TINY), "--stages", "rlhf", "--from", f"hf:someorg/tiny-qwen@{COMMIT}", "--json", home=baton_home,
              env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    planned = json.loads(r.stdout)
    local = baton_home / "hub" / "someorg--tiny-qwen" / COMMIT
    assert planned["input"] == f"hf:someorg/tiny-qwen@{COMMIT} (hf-safetensors)" and (local / "baton_manifest.json").exists()
    manifest = json.loads((local / "baton_manifest.json").read_text())
    assert manifest["architecture"]["architectures"] == ["Qwen2ForCausalLM"] and manifest["tokenizer"]["chat_template"]

    r = baton("config", str(TINY), "--stages", "rlhf", "--from", "hf:someorg/tiny-qwen", home=baton_home,
              env={**env, "HF_HUB_CACHE": str(tmp_path / "empty")}, timeout=300)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("baton: --from hf:someorg/tiny-qwen: offline mode is on (HF_HUB_OFFLINE=1) and it is not "
                           "in the local cache"), line


def test_a_model_without_chat_template_is_refused_before_launch(tmp_path, baton_home, tokenizer_dir):
    model = tiny_model(tmp_path / "model", tokenizer_dir, chat_template=False)
    assert baton("manifest", str(model), home=baton_home, timeout=300).returncode == 0
    r = baton("run", str(TINY), "--stages", "finetune", "--from", str(model), home=baton_home, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "has no chat template" in r.stderr and "set model.chat_template" in r.stderr
    assert "chat_template.jinja" in r.stderr
    assert not (baton_home / "runs").exists()
