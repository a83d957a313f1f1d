"""Bad configs fail fast, before anything launches, with a message naming the key."""
import time

import pytest

from conftest import REPO, TINY, baton
from flows.config import ConfigError, load
from flows.chain_planner import plan


def test_unknown_key_fails_fast_naming_it(baton_home, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text() + "\nfinetune:\n  zero_stagee: 2\n")
    t0 = time.time()
    r = baton("run", str(bad), home=baton_home, timeout=60)
    assert time.time() - t0 < 60  # no Prefect, MLflow or engine started (~1 s idle; generous for a busy machine)
    assert r.returncode == 2
    assert "finetune.zero_stagee: unknown key" in r.stderr
    assert not (baton_home / "runs").exists()  # nothing launched, nothing written


def test_wrong_type_fails_fast_naming_it(baton_home):
    t0 = time.time()
    r = baton("run", str(TINY), "--set", "model.num_layers=many", home=baton_home, timeout=60)
    assert time.time() - t0 < 60  # no Prefect, MLflow or engine started (~1 s idle; generous for a busy machine)
    assert r.returncode == 2
    assert "model.num_layers" in r.stderr and "valid integer" in r.stderr


def test_overrides_are_validated_and_applied():
    cfg = load(TINY, ["model.num_layers=2", "data.seed=7", "tracking.registered_model=m"])
    assert cfg.model.num_layers == 2 and cfg.data.seed == 7 and cfg.tracking.registered_model == "m"
    with pytest.raises(ConfigError, match="model: .*not divisible"):
        load(TINY, ["model.num_attention_heads=3"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load(TINY, ["model.num_layers"])


def test_stage_order_is_enforced():
    with pytest.raises(ConfigError, match="must follow the order"):
        load(TINY, stages=["rlhf", "pretrain"])
    with pytest.raises(ConfigError, match="stages.0"):
        load(TINY, stages=["pretrian"])


def test_conversions_are_inserted_where_formats_differ():
    cfg = load(TINY)
    steps = plan(cfg)
    labels = [s.label for s in steps]
    assert labels[:3] == ["data", "pretrain", "convert-megatron-to-hf"]
    conv = steps[2]
    assert (conv.extra["from_format"], conv.extra["to_format"], conv.extra["source_stage"]) == (
        "megatron-dist", "hf-safetensors", "pretrain")
    assert "convert-zero-to-hf" in labels and labels.index("convert-zero-to-hf") == labels.index("finetune") + 1
    # a run that ends on a non-HF format ends with a conversion to HF
    assert [s.label for s in plan(load(TINY, stages=["data", "pretrain"]))][-1] == "convert-megatron-to-hf"
    # an explicit convert is not doubled
    assert [s.label for s in plan(load(TINY, stages=["data", "pretrain", "convert"]))] == [
        "data", "pretrain", "convert-megatron-to-hf"]


def test_fingerprints_follow_config_and_lineage():
    a = plan(load(TINY))
    b = plan(load(TINY, ["finetune.steps=11"]))
    same = [x.fingerprint == y.fingerprint for x, y in zip(a, b)]
    i = [s.label for s in a].index("finetune")
    assert all(same[:i]) and not any(same[i:])  # the change and everything downstream re-runs


def test_lora_on_a_mixture_of_experts_is_refused_when_the_config_is_read():
    """tiny-moe.yaml's model is a mixture of experts: finetune LoRA is refused before the run starts, naming the key
    (peft's target_modules cannot reach transformers' fused experts; docs/moe.md)."""
    moe = REPO / "configs" / "tiny-moe.yaml"
    with pytest.raises(ConfigError, match=r"finetune\.lora\.enabled: the model is a mixture of experts \(model\.moe: "
                                          r"4 experts\).*target_modules"):
        load(moe, ["finetune.lora.enabled=true"])
    load(moe)
    load(TINY, ["finetune.lora.enabled=true"])  # a dense model keeps LoRA


def test_the_real_grpo_recipe_loads_with_its_own_task_and_a_held_out_set_of_40():
    """configs/real-smollm2-grpo.yaml (its learning is measured by benchmarks/real_grpo_bench.py, not here): the
    config validates, its task is the shipped instruction sums and its reward the exact sum."""
    from tasks.data.task import build_datasets

    cfg = load(REPO / "configs" / "real-smollm2-grpo.yaml")
    assert cfg.stages == ["data", "rlhf"] and cfg.rlhf.algorithm == "grpo" and cfg.data.prompts.task == "instruction"
    assert [r.kind for r in cfg.rlhf.rewards] == ["exact_match"] and cfg.rlhf.rollout_engine == "hf"
    assert len(build_datasets(cfg.data)[0]["prompts"][1]) == 40
