"""llama.cpp as a serving engine (tasks/serve/llamacpp.py): llama-server from the llamacpp runtime on the tiny
model's f16 export, with the smoke checks of the HF engines (models, 401 without the key, a chat rendered with the
GGUF's own template) and greedy token parity with HF generate on the GGUF's own weights."""
from __future__ import annotations

import pytest

from conftest import cli


@pytest.fixture(scope="module")
def f16_export(tmp_path_factory, hf_checkpoint):
    dest = tmp_path_factory.mktemp("llamacpp") / "f16"
    r = cli("export", str(hf_checkpoint), str(dest), "--type", "f16", home=dest.parent / "home")
    assert r.returncode == 0, r.stdout + r.stderr
    return dest


def config():
    from tasks.serve.config import ServeConfig, SmokeConfig

    return ServeConfig(health_timeout_s=120, smoke=SmokeConfig(parity_prompts=2, parity_tokens=16))


def test_llama_server_serves_the_f16_export_with_greedy_parity(f16_export, tmp_path):
    from tasks.serve import llamacpp

    served = llamacpp.check_gguf(f16_export, config(), tmp_path)
    checks = {c["name"]: c for c in served.report["checks"]}
    assert served.report["passed"], served.report
    assert set(checks) == {"smoke.models", "smoke.auth_401", "smoke.chat", "smoke.greedy_parity"}
    assert "2 prompts x 16 tokens identical" in checks["smoke.greedy_parity"]["detail"]

