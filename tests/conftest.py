"""Shared fixtures: an isolated BATON_HOME (MLflow SQLite store, runs, index), the data stage's output, and a small
random-init HF checkpoint with the data stage's tokenizer, for stages that start from HF weights."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flows.cli import QUIET_ENV

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

# One Prefect database per test session (the ephemeral server migrates it once), never the user's ~/.prefect.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="baton-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture
def baton_home(tmp_path, monkeypatch):
    home = tmp_path / "baton-home"
    home.mkdir()
    monkeypatch.setenv("BATON_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


def baton(*args: str, home: Path, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full = dict(os.environ, BATON_HOME=str(home), **(env or {}))
    full.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_config():
    from flows.config import load

    return load(TINY)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, tiny_config) -> Path:
    """The data stage's output for configs/tiny.yaml (datasets + tokenizer + manifest), built once per session."""
    from conversions import manifest as mf
    from tasks.data.task import write_data
    from tasks.stage import StageContext

    out = tmp_path_factory.mktemp("data")
    ctx = StageContext(stage="data", run_id="test", run_dir=out, work_dir=out, model=tiny_config.model.model_dump(),
                       seed=0)
    write_data(ctx, tiny_config.data)
    mf.write(out, mf.build(out, format="dataset", stage="data", tokenizer_dir=out / "tokenizer"))
    return out


def make_hf_checkpoint(dest: Path, arch: dict, tokenizer_dir: Path, seed: int = 0, tie: bool | None = None) -> Path:
    """A random-init LlamaForCausalLM saved the way any HF user would (save_pretrained), plus tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from conversions import hf

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    arch = dict(arch)
    if tie is not None:
        arch["tie_word_embeddings"] = tie
    config = hf.llama_config(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_config, data_dir) -> Path:
    """A random-init HF checkpoint of the tiny architecture with a manifest (read-only: copy before changing it)."""
    from conversions import hf, manifest as mf

    dest = make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", tiny_config.model.model_dump(), data_dir / "tokenizer")
    mf.write(dest, mf.build(dest, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(dest),
                            dtype="float32", architecture=tiny_config.model.model_dump()))
    return dest


# the real local stack (make up) and what runs on it, shared by test_ops* and test_browser*
from ops_stack import initial_champion, ops_stack, retrain_outcomes  # noqa: E402,F401


# Markers by module, so `make test-fast` (-m fast) is the inner loop and the heavy families can be picked out:
# fast = no engine, server, stack or cluster is started. A test's own marker wins; an unlisted module counts as slow.
FAST_MODULES = {"test_vocabulary", "test_config", "test_pretrain_config", "test_distributed", "test_rlhf_nemo_rl",
                "test_verify", "test_launch", "test_serve_preflight"}
FAMILIES = {"test_serve": "serve", "test_serve_promotion": "serve", "test_ops": "ops", "test_ops_postgres": "ops",
            "test_browser": "ops"}
KINDS = ("fast", "slow", "serve", "ops", "gpu")


def pytest_configure(config):
    import reliability_table

    if not config.pluginmanager.is_registered(reliability_table):
        config.pluginmanager.register(reliability_table, "reliability_table")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in FAMILIES:
            item.add_marker(FAMILIES[module])
        if not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker("fast" if module in FAST_MODULES else "slow")
