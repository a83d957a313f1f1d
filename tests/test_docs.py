"""The docs site builds strictly (a broken link or a page left out of the nav fails), and the generated reference
pages (config keys from the pydantic models, `baton` subcommands from the parser) are the ones committed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

GENERATED = REPO / "docs" / "reference"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "infra" / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_are_current(tmp_path):
    gen = _generator()
    gen.write(tmp_path)
    stale = [page for page in gen.PAGES if (tmp_path / page).read_text() != (GENERATED / page).read_text()]
    assert not stale, f"docs/reference/{', '.join(stale)} out of date with the code: run make docs"


def test_config_reference_lists_every_key_with_type_and_default():
    from flows.config import PipelineConfig

    page = (GENERATED / "config.md").read_text()
    for stage in ("data", "pretrain", "rlhf", "finetune", "convert", "serve"):
        model = type(getattr(PipelineConfig(), stage))
        for key in model.model_fields:
            assert f"| `{stage}.{key}` | `" in page, f"{stage}.{key} missing from the config reference"
    assert "| `finetune.zero.offload_params` | `" in page and "| `runtimes.<name>.kind` | `" in page


def test_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # (no -q: it hides the warnings that --strict counts)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
