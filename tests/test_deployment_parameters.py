"""Issue 25: whoever may start a deployment's flow run with parameters (the Prefect API, the UI's Run form) may not
choose the program it launches. A deployment run refuses `runtimes.*` (interpreter, checkout, image, env such as
PYTHONPATH, cluster), extra engine flags, lm-eval task folders and NeMo-RL overrides from its parameters, naming the
key, unless the worker was started with BATON_ALLOW_LAUNCH_PARAMETERS=1. `baton run` reads the user's own file."""
from __future__ import annotations

import sys

import pytest

from conftest import TINY
from flows.config import ALLOW_LAUNCH_PARAMETERS, ConfigError, launch_parameter_error, load

pytestmark = [pytest.mark.fast, pytest.mark.reliability]
DEPLOYMENT_ID = "PREFECT__RUNTIME__DEPLOYMENT__ID"  # Prefect's own switch for what prefect.runtime.deployment says


@pytest.fixture(autouse=True)
def worker_env(monkeypatch):
    monkeypatch.delenv(ALLOW_LAUNCH_PARAMETERS, raising=False)
    monkeypatch.delenv(DEPLOYMENT_ID, raising=False)


@pytest.mark.parametrize("override, key", [
    (f"runtimes.main.python={sys.executable}", "runtimes.main"),
    ("runtimes.main.env.PYTHONPATH=/tmp/planted", "runtimes.main"),
    ("serve.engine_args.vllm=[--worker-cls, planted.Worker]", "serve.engine_args"),
    ("serve.lm_eval.include_path=/tmp", "serve.lm_eval.include_path"),
    ("rlhf.nemo_rl.overrides=[policy.model_name=planted]", "rlhf.nemo_rl.overrides"),
], ids=["python", "env", "engine_args", "lm_eval_tasks", "nemo_rl_overrides"])
def test_launch_shaping_parameters_are_refused_naming_the_key(override, key, monkeypatch, record_property):
    record_property("fault", "launch-shaping key in a deployment run's parameters")
    cfg = load(TINY, [override])
    problem = launch_parameter_error(cfg)
    assert problem.startswith(f"parameters set {key}: these decide what program the run launches"), problem
    monkeypatch.setenv(ALLOW_LAUNCH_PARAMETERS, "1")  # the worker's owner allows it
    assert launch_parameter_error(cfg) is None


def test_a_deployment_run_refuses_before_anything_starts(monkeypatch, tmp_path):
    from flows.pipeline import pipeline, refuse_launch_parameters

    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))
    planted = load(TINY, ["runtimes.main.env.PYTHONPATH=/tmp/planted"])
    refuse_launch_parameters(planted)  # `baton run`: the user's own config
    monkeypatch.setenv(DEPLOYMENT_ID, "7d0c1c3e-0000-4000-8000-000000000001")
    refuse_launch_parameters(load(TINY))  # a deployment's usual parameters pass
    with pytest.raises(ConfigError, match=r"^parameters set runtimes\.main: "):
        pipeline.fn(planted)
    assert not (tmp_path / "home").exists()  # no run folder, no tracking, nothing launched
