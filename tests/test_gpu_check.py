"""benchmarks/gpu_check.py, the script a lent GPU machine runs (`make gpu-check`): its configs validate, the wheels it
carries are the main runtime's locked versions, and the whole check runs on CPU with the tiny model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.fast
def test_every_carried_wheel_has_a_locked_version():
    locked = gpu_check.locked_versions()
    assert [n for n in gpu_check.CARRY if n not in locked] == []
    assert gpu_check.SDIST_ONLY <= set(gpu_check.CARRY)


@pytest.mark.fast
@pytest.mark.parametrize("profile", sorted(gpu_check.PROFILES))
def test_profiles_are_valid_pipeline_configs(profile):
    """The GPU profile's ~1B layout passes the pipeline's validation (checked here with device cpu, as no GPU is
    visible: every other key is what the GPU machine gets)."""
    from flows.config import load

    for extra in gpu_check.ZERO_RUNS.values():
        cfg = load(gpu_check.TINY, gpu_check.overrides(profile, "cpu", extra),
                   stages=["data", "pretrain", "rlhf", "finetune"])
        assert cfg.finetune.nproc_per_node == 1 and cfg.rlhf.backend == "trl"
    if profile == "cuda":
        m = cfg.model
        params = m.num_layers * (2 * m.hidden_size ** 2 + 2 * m.hidden_size * m.hidden_size * m.num_query_groups
                                 // m.num_attention_heads + 3 * m.hidden_size * m.ffn_hidden_size)
        params += 2 * cfg.pretrain.vocab_size * m.hidden_size
        assert 0.9e9 < params < 1.3e9
        assert cfg.pretrain.precision == cfg.finetune.precision == cfg.rlhf.precision == "bf16"


@pytest.mark.slow
@pytest.mark.long  # Megatron, ZeRO-3 with CPU offload and both conversions (~1 min): make test-long
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """`make gpu-check DEVICE=cpu`, reduced to what only it covers: the check's own parts (versions, unmet
    requirements, per-part results, on-device parity of each conversion, the JSON it writes) around Megatron pretraining
    and ZeRO-3 with the optimizer offloaded to CPU, the one engine layout no other test of `make test` runs. (ZeRO-2
    and DPO, its other parts, run in the session's default chain.)"""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--out",
                           str(tmp_path), "--parts", "zero3_offload"], cwd=REPO, capture_output=True, text=True,
                          timeout=1500)
    result = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["passed"] and result["tokens_per_s"] > 0 and 0 < result["mfu"]
    assert result["versions"]["megatron-core"] and result["versions"]["deepspeed"] and result["versions"]["trl"]
    z = result["zero3_offload"]
    assert z["step_time_s"] > 0 and z["peak_allocated_mb"] > 0, z
    assert result["convert_zero3_offload"]["parity_on_device"]["passed"]
    assert z["zero"]["offload_optimizer"]["device"] == "cpu"
    assert result["convert_pretrain"]["parity_on_device"]["max_abs_diff"] <= 1e-4
    assert "zero2" not in result and "dpo" not in result  # the parts not asked for are not run
