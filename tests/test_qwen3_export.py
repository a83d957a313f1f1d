"""Qwen3 and Qwen3-MoE as Megatron's export targets (model.arch qwen3): transformers' own models through from_hf and
to_hf bit for bit, with each head's q/k RMSNorm as Megatron's q_layernorm / k_layernorm; variants the mapping would
change refused naming the key; and (long) a Qwen3-MoE pretrained by Megatron-Core exported with its gate's logits
parity against Megatron's own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conversions import hf, megatron

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {"Qwen3ForCausalLM": ("Qwen3Config", {}),
            "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=48, norm_topk_prob=True))}


def hf_model(dest: Path, architecture: str, **overrides) -> Path:
    import transformers

    config_cls, extra = FAMILIES[architecture]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(0)
    getattr(transformers, architecture)(config).save_pretrained(str(dest))
    return dest


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in hf.safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


@pytest.mark.fast
@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_a_qwen3_goes_to_megatron_and_back_bit_for_bit(tmp_path, architecture):
    src = hf_model(tmp_path / "hf", architecture)
    info = megatron.from_hf(src, tmp_path / "megatron")
    assert info["architecture"]["arch"] == "qwen3"
    shapes = {k: megatron.DistReader(tmp_path / "megatron").shape(k) for k in megatron.QK_NORM.values()}
    assert set(shapes.values()) == {(2, 16)}, shapes  # one RMSNorm weight per head width, per layer
    megatron.to_hf(tmp_path / "megatron", tmp_path / "back")
    before, after = tensors(src), tensors(tmp_path / "back")
    assert set(after) == set(before)
    assert [k for k in before if not after[k].equal(before[k])] == []
    assert "model.layers.1.self_attn.q_norm.weight" in after
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["head_dim"] == 16
    if architecture == "Qwen3MoeForCausalLM":
        from transformers import AutoConfig

        assert "model.layers.1.mlp.experts.3.down_proj.weight" in after and "model.layers.0.mlp.gate.weight" in after
        read = AutoConfig.from_pretrained(str(tmp_path / "back"))
        assert (read.num_experts, read.num_experts_per_tok, read.moe_intermediate_size, read.norm_topk_prob,
                read.mlp_only_layers) == (4, 2, 48, True, [])


@pytest.mark.fast
@pytest.mark.parametrize("overrides, named", [
    (dict(norm_topk_prob=False), "norm_topk_prob false: Megatron routes with the top-k weights renormalised"),
    (dict(mlp_only_layers=[1]), "dense MLP layers among the experts' (mlp_only_layers [1]"),
    (dict(head_dim=32), "head_dim 32: Megatron's GPT here has hidden_size / num_attention_heads = 16"),
])
def test_a_qwen3_moe_megatron_would_compute_differently_is_refused(tmp_path, overrides, named):
    src = hf_model(tmp_path / "hf", "Qwen3MoeForCausalLM", **overrides)
    with pytest.raises(megatron.MegatronCheckpointError, match="Qwen3MoeForCausalLM") as e:
        megatron.from_hf(src, tmp_path / "megatron")
    assert named in str(e.value), e.value


QWEN3_MOE = ["model.arch=qwen3", "model.moe.num_experts=4", "model.moe.top_k=2",
             "model.moe.expert_ffn_hidden_size=96", "model.moe.aux_loss_coef=0.01"]


@pytest.mark.long  # ~60 s: a Megatron run of its own
def test_megatron_pretrains_a_qwen3_moe_and_exports_it_with_logits_parity(tmp_path, data_dir):
    """Megatron-Core with q/k layer norms and experts (EP 2) trains; the convert step writes a Qwen3-MoE whose logits
    match Megatron's own (the gate's L2), and from_hf brings every weight back bit for bit."""
    from flows.config import load
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert
    from tasks.stage import StageContext
    from conftest import TINY
    from test_moe_pretrain import assert_expert_load
    from test_pretrain_megatron import assert_trained, dist_tensors, run_stage

    out = run_stage(tmp_path / "pretrain", data_dir, *QWEN3_MOE, "pretrain.nproc_per_node=2",
                    "pretrain.expert_parallel=2")
    assert_trained(out)
    assert_expert_load(out, steps=12)
    cfg = load(TINY, QWEN3_MOE, stages=["data", "pretrain"])
    work = tmp_path / "convert"
    ctx = StageContext(stage="convert", run_id="test", run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=0, input=out.output, input_format="megatron-dist",
                       extra={"from_format": "megatron-dist", "to_format": "hf-safetensors", "source_stage": "pretrain"})
    conv = run_convert.fn(ctx, ConvertConfig())
    assert conv.gate["passed"], json.dumps(conv.gate, indent=1)
    checks = {c["name"]: c for c in conv.gate["checks"]}
    print(checks["L2.logits_parity"]["detail"])
    assert checks["L2.logits_parity"]["passed"] and checks["L1.source_tensors"]["passed"]
    assert json.loads((conv.output / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    back = tmp_path / "megatron"
    vocab = megatron.from_hf(conv.output, back)["vocab_size"]  # the tokenizer's rows (the rest is padding)
    original, returned = dist_tensors(out.output), dist_tensors(back)
    weights = {k: v for k, v in original.items() if not k.startswith("chained_")}
    assert set(returned) == set(weights)
    for key, t in weights.items():
        if key in (megatron.EMBEDDING, megatron.OUTPUT):
            t, returned[key] = t[:vocab], returned[key][:vocab]
        assert returned[key].equal(t), key
