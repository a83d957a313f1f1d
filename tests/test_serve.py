"""The serve stage for real: the random-init `hf_checkpoint` served by vLLM, then by SGLang (one server at a time),
every smoke check passing on both, lm-eval scored, `champion` set; then `baton rollback` moves it back.

Checks that hold for an untrained model: JSON validity through constrained decoding, regex, SGLang frontend program,
greedy token ids equal to HF generate, 401 without the key.
"""
from __future__ import annotations

import os
import shutil
import stat

from conftest import baton

from tasks import tracking
from tasks.serve.config import ServeConfig
from tasks.serve.task import serve
from tasks.stage import StageContext

NAME = "serve-e2e"
SMOKE = ["server", "smoke.models", "smoke.auth_401", "smoke.chat", "smoke.json_schema", "smoke.regex",
         "smoke.greedy_parity"]


def test_serve_vllm_then_sglang_promotes_champion_and_rollback(tmp_path, baton_home, hf_checkpoint, data_dir,
                                                               tiny_config):
    work = tmp_path / "serve"
    ctx = StageContext(stage="serve", run_id="test", run_dir=tmp_path, work_dir=work,
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors", tracking={"registered_model": NAME})
    cfg = ServeConfig(engine="both", lm_eval={"limit": 8})
    out = serve(ctx, cfg)

    checks = {c["name"]: c for c in out.gate["checks"]}
    failed = {n: c["detail"] for n, c in checks.items() if not c["passed"]}
    assert out.gate["passed"], failed
    for engine in ("vllm", "sglang"):
        for name in SMOKE:
            assert checks[f"{engine}.{name}"]["passed"], (engine, name)
    assert checks["sglang.smoke.sgl_frontend"]["passed"]
    assert "20/20 strictly valid" in checks["vllm.smoke.json_schema"]["detail"]
    assert "20/20 strictly valid" in checks["sglang.smoke.json_schema"]["detail"]
    assert "401" in checks["vllm.smoke.auth_401"]["detail"]
    assert out.engine == "vllm+sglang"
    assert out.metrics["json_valid_rate"] == 1.0
    for engine in ("vllm", "sglang"):
        assert out.metrics[f"{engine}_tokens_per_s"] > 0 and out.metrics[f"{engine}_ttft_s"] > 0

    # lm-eval ran against the live server and its score is recorded.
    assert out.eval["metric"] == "lm_eval_exact_match"
    assert 0.0 <= out.eval["after"] <= 1.0
    assert out.metrics["lm_eval_baton_sft_heldout_sample_len"] == 8

    # Served as <registered name>:<version> (SGLang forbids ':'), and promoted.
    c = tracking.client()
    version = out.extra["champion"]["version"]
    assert out.extra["served_model_name"] == f"{NAME}:{version}"
    assert out.extra["served_model_names"] == {"vllm": f"{NAME}:{version}", "sglang": f"{NAME}-v{version}"}
    champ = c.get_model_version_by_alias(NAME, "champion")
    assert str(champ.version) == str(version)
    assert float(champ.tags["lm_eval_exact_match"]) == out.eval["after"]

    # The API key: generated, 0600, never in a log.
    key_file = work / "api_key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = key_file.read_text().strip()
    for log in work.glob("*.log"):
        assert key not in log.read_text(errors="replace"), log
    assert (work / "server-vllm.log").exists() and (work / "server-sglang.log").exists()

    # A newer champion, then `baton rollback` moves the alias back; the replaced version stays registered.
    newer = tmp_path / "newer"
    shutil.copytree(hf_checkpoint, newer)
    v2 = tracking.register_checkpoint(c, NAME, newer, None, tags={"stage": "test"}, alias=None)
    tracking.promote_champion(c, NAME, v2)
    assert str(c.get_model_version_by_alias(NAME, "champion").version) == str(v2)
    assert str(c.get_model_version_by_alias(NAME, "previous-champion").version) == str(version)
    r = baton("rollback", NAME, home=baton_home)
    assert r.returncode == 0, r.stderr
    assert f"from version {v2} to version {version}" in r.stdout
    assert str(c.get_model_version_by_alias(NAME, "champion").version) == str(version)
    assert c.get_model_version(NAME, v2).tags["baton.rolled_back"] == "true"
    r = baton("rollback", NAME, home=baton_home)
    assert r.returncode == 1 and "first champion" in r.stderr


def test_sgl_kernel_stub_imports_and_fails_loudly_when_called():
    """The CPU stand-in lets sglang import its kernels; calling one names the op instead of computing garbage."""
    import subprocess

    from tasks.runtimes import python_for

    code = ("import sgl_kernel, sgl_kernel.kvcacheio as kv\n"
            "from sgl_kernel import silu_and_mul\n"
            "try:\n    kv.transfer_kv_all_layer(1)\nexcept NotImplementedError as e:\n    print('raised:', e)\n")
    r = subprocess.run([python_for("sglang"), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "raised: sgl_kernel.kvcacheio.transfer_kv_all_layer" in r.stdout
    assert "import-only stub" in r.stdout
