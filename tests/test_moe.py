"""Bring your own mixture of experts through finetune: a tiny Qwen3-MoE (ZeRO-3, torchrun) and a tiny Mixtral (ZeRO-2,
deepspeed launcher), built from transformers' own configs with the data stage's tokenizer, trained on 2 CPU ranks
with the router's auxiliary loss, and exported ZeRO → HF through the convert step and its gate: the files hold the
per-expert layout the input had (what from_pretrained and the servers read), and transformers loads them back into
exactly the engine's fused expert parameters."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, baton
from conversions import hf, manifest as mf, probe
from tasks import events
from tasks.finetune.config import FinetuneConfig

# 4 experts, top-2, 2 layers; the expert FFN width (48) differs from hidden (64): a transposed expert changes shape
MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=48, intermediate_size=96)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=48)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # with a shared expert beside the routed ones
                  dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                       intermediate_size=96)),
}
STEPS = 4


def make_moe_checkpoint(dest: Path, family: str, tokenizer_dir: Path, seed: int = 0, **shape) -> Path:
    """A random-init MoE of transformers' own config class, saved with save_pretrained (per-expert tensors on
    disk), plus the tokenizer and a manifest; `shape` overrides MOE's sizes."""
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, sizes = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = getattr(transformers, config_cls)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               **{**MOE, **sizes, **shape})
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(config).save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    mf.write(dest, mf.build(dest, format="hf-safetensors", stage="external", dtype="float32",
                            parameter_count=hf.parameter_count(dest)))
    return dest


def finetune_and_convert(tmp: Path, family: str, zero_stage: int, launcher: str, tiny_config, data_dir):
    """The input checkpoint, the finetune stage's output and the convert step's output (each with its gate)."""
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert
    from tasks.finetune.task import run_finetune
    from tasks.stage import StageContext

    src = make_moe_checkpoint(tmp / "input", family, data_dir / "tokenizer")
    work = tmp / "finetune"
    ctx = StageContext(stage="finetune", run_id="test", run_dir=work, work_dir=work,
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=src,
                       input_format="hf-safetensors")
    cfg = FinetuneConfig(zero={"stage": zero_stage}, steps=STEPS, warmup_steps=1, checkpoint_every=STEPS,
                         micro_batch_size=4, lr=3e-3, launcher=launcher, gate={"metric": "heldout_loss"},
                         timeout_s=900)
    fine = run_finetune.fn(ctx, cfg)
    conv_work = tmp / "convert"
    conv_ctx = StageContext(stage="convert", run_id="test", run_dir=conv_work, work_dir=conv_work,
                            model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=fine.output,
                            input_format="deepspeed-zero",
                            extra={"from_format": "deepspeed-zero", "to_format": "hf-safetensors"})
    return src, fine, run_convert.fn(conv_ctx, ConvertConfig())


@pytest.fixture(scope="module")
def qwen3_moe_zero3(tmp_path_factory, tiny_config, data_dir):
    return finetune_and_convert(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe", 3, "torchrun", tiny_config, data_dir)


@pytest.fixture(scope="module")
def mixtral_zero2(tmp_path_factory, tiny_config, data_dir):
    return finetune_and_convert(tmp_path_factory.mktemp("mixtral"), "mixtral", 2, "deepspeed", tiny_config, data_dir)


@pytest.fixture(scope="module")
def qwen2_moe_zero2(tmp_path_factory, tiny_config, data_dir):
    return finetune_and_convert(tmp_path_factory.mktemp("qwen2moe"), "qwen2_moe", 2, "torchrun", tiny_config, data_dir)


def logged_metrics(work: Path) -> list[dict]:
    found = (events.parse(line.strip()) for line in (work / "engine.log").read_text().splitlines())
    return [e for e in found if e and e["kind"] == "metric"]


def assert_moe_relay(src: Path, fine, conv, zero_stage: int, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
    from transformers import AutoModelForCausalLM

    assert fine.gate["passed"], fine.gate
    assert fine.extra["zero"]["stage"] == zero_stage
    # the router's load-balancing loss was part of the training loss, and logged on its own
    aux = [m[events.TRAIN_ROUTER_AUX_LOSS] for m in logged_metrics(fine.output.parent)
           if events.TRAIN_ROUTER_AUX_LOSS in m]
    assert aux and all(a > 0 for a in aux), aux
    checks = {c["name"]: c for c in conv.gate["checks"]}
    assert conv.gate["passed"], conv.gate
    assert {"L1.roundtrip", "L2.logits_parity", "L3.generation"} <= set(checks)
    # the gate ran at this process's thread count; at the workers' one (OMP_NUM_THREADS=1) the export's logits are
    # the engine's own, bit for bit (2 threads sum the experts' outputs in another order: ~1e-7 off)
    ids, reference = probe.load_reference(fine.output / probe.PROBE_FILE)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(probe.hf_logits(conv.output, ids), reference)
    finally:
        torch.set_num_threads(threads)
    # the layout HF writes: the input's tensor names and shapes (per expert), nothing else
    assert hf.tensor_shapes(conv.output) == hf.tensor_shapes(src)
    # transformers' own loader merges them back into exactly the engine's parameters (DeepSpeed's consolidation,
    # which keeps the engine's fused names)
    convert_zero_checkpoint_to_state_dict(str(fine.output), str(tmp_path / "deepspeed"), safe_serialization=True)
    engine = hf.load_state_dict(tmp_path / "deepspeed")
    assert any(t.ndim == 3 for t in engine.values())  # fused experts: [experts, out, in]
    loaded = AutoModelForCausalLM.from_pretrained(str(conv.output), dtype=torch.float32).state_dict()
    assert loaded.keys() == engine.keys()
    for name, t in engine.items():
        assert torch.equal(loaded[name], t), f"{name} differs"
    # and trained: some expert moved away from the input
    before = hf.load_state_dict(src)
    after = hf.load_state_dict(conv.output)
    assert any(not torch.equal(before[n], after[n]) for n in before if ".experts." in n)


def test_qwen3_moe_finetunes_under_zero3_and_exports_exactly(qwen3_moe_zero3, tmp_path):
    src, fine, conv = qwen3_moe_zero3
    assert_moe_relay(src, fine, conv, 3, tmp_path)
    assert any(".mlp.experts.3.down_proj.weight" in n for n in hf.tensor_shapes(conv.output))


@pytest.mark.long  # ~45 s of CPU (80 s on a busy 2-core machine): the Qwen3-MoE test covers the code in make test
def test_mixtral_finetunes_under_zero2_and_exports_exactly(mixtral_zero2, tmp_path):
    src, fine, conv = mixtral_zero2
    assert_moe_relay(src, fine, conv, 2, tmp_path)
    assert any(".block_sparse_moe.experts.3.w2.weight" in n for n in hf.tensor_shapes(conv.output))


@pytest.mark.long  # its own finetune run (~45 s of CPU): Qwen2-MoE's shared expert through finetune and export
def test_qwen2_moe_with_a_shared_expert_finetunes_and_exports_exactly(qwen2_moe_zero2, tmp_path):
    src, fine, conv = qwen2_moe_zero2
    assert_moe_relay(src, fine, conv, 2, tmp_path)
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in hf.tensor_shapes(conv.output)


# ---- the conversion gate names a faulty expert ------------------------------------------------------------------
def faulty_copy(conv_output: Path, dest: Path, fault) -> Path:
    """The converted checkpoint as a faulty converter would have written it: `fault` changes its tensors, then the
    manifest is written for the changed files (so integrity passes and only the checks of the weights can fail)."""
    from safetensors.torch import save_file

    shutil.copytree(conv_output, dest)
    tensors = hf.load_state_dict(dest)
    fault(tensors)
    for f in hf.safetensors_files(dest):
        f.unlink()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    m = mf.read(conv_output)
    mf.write(dest, mf.build(dest, format=m["format"], stage=m["stage"], parent=m.get("parent"), dtype=m.get("dtype"),
                            tokenizer_dir=dest))
    return dest


def swap_experts_0_and_1(t: dict) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.0.mlp.experts.{e}.{proj}.weight" for e in (0, 1))
        t[a], t[b] = t[b], t[a]


def transpose_an_expert(t: dict) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    t[name] = t[name].T.contiguous()


def drop_the_shared_expert(t: dict) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        del t[f"model.layers.0.mlp.shared_expert.{proj}.weight"]


def source_check(gate: dict) -> dict:
    return next(c for c in gate["checks"] if c["name"] == "L1.source_tensors")


def refused(conv, fine, fault, tmp_path: Path) -> dict:
    from tasks.convert.task import gate

    assert source_check(conv.gate)["passed"], conv.gate  # the same checkpoint, unchanged, passes the check
    bad = faulty_copy(conv.output, tmp_path / "faulty", fault)
    g = gate(bad, fine.output, "hf-safetensors")
    assert not g["passed"] and not source_check(g)["passed"], g
    return source_check(g)


def test_a_wrong_expert_order_fails_the_gate_naming_the_tensor(qwen3_moe_zero3, tmp_path):
    _, fine, conv = qwen3_moe_zero3
    detail = refused(conv, fine, swap_experts_0_and_1, tmp_path)["detail"]
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight: differs from the source (holds the source's "
            "model.layers.0.mlp.experts.1.gate_proj.weight") in detail, detail


def test_a_transposed_expert_fails_the_gate_naming_the_tensor(qwen3_moe_zero3, tmp_path):
    _, fine, conv = qwen3_moe_zero3
    detail = refused(conv, fine, transpose_an_expert, tmp_path)["detail"]
    assert "model.layers.1.mlp.experts.2.down_proj.weight: transposed (shape (48, 64), the source's (64, 48))" \
        in detail, detail


@pytest.mark.long  # needs the Qwen2-MoE run above
def test_a_dropped_shared_expert_fails_the_gate_naming_the_tensor(qwen2_moe_zero2, tmp_path):
    _, fine, conv = qwen2_moe_zero2
    detail = refused(conv, fine, drop_the_shared_expert, tmp_path)["detail"]
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight: in the source, missing from the output" in detail, \
        detail



# ---- rlhf: GRPO on a Mixtral with the router's load-balancing loss --------------------------------------------
def test_grpo_on_a_mixtral_adds_the_routers_aux_loss_to_its_loss(tmp_path, tiny_config, data_dir):
    """TRL's GRPO on a Mixtral (router_aux_loss_coef 0.001, transformers' default) trains with the router's
    load-balancing loss and logs it as train/router_aux_loss. The random-init model's first rollouts all earn the
    preference reward 0, so every advantage is 0 and, without a KL term (beta 0), the policy loss and its gradient are
    exactly 0: the step's loss is the coefficient times the aux loss alone, and the aux loss's gradient alone moves the
    weights (the routers, not the output layer, which it does not reach). Dropping the aux loss fails all three."""
    from tasks.rlhf.config import RlhfConfig
    from tasks.rlhf.task import run_rlhf
    from tasks.stage import StageContext

    src = make_moe_checkpoint(tmp_path / "input", "mixtral", data_dir / "tokenizer")
    coef = json.loads((src / "config.json").read_text())["router_aux_loss_coef"]
    work = tmp_path / "rlhf"
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=work, work_dir=work, model=tiny_config.model.model_dump(),
                       seed=0, data_dir=data_dir, input=src, input_format="hf-safetensors")
    cfg = RlhfConfig(algorithm="grpo", steps=1, micro_batch_size=4, num_generations=4, max_completion_length=4,
                     lr=1e-3, beta=0.0, checkpoint_every=1000, timeout_s=600)
    out = run_rlhf.fn(ctx, cfg)
    assert out.gate["passed"], out.gate
    (step,) = [m for m in logged_metrics(work) if events.TRAIN_LOSS in m]
    assert step["train/reward"] == 0.0 and step["train/reward_std"] == 0.0, step
    aux = step[events.TRAIN_ROUTER_AUX_LOSS]
    assert aux > 0 and step[events.TRAIN_LOSS] == pytest.approx(coef * aux, rel=1e-5), step
    before, after = hf.load_state_dict(src), hf.load_state_dict(out.output)
    assert all(not torch.equal(before[n], after[n]) for n in before if n.endswith("block_sparse_moe.gate.weight"))
    assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])


def test_dpo_on_a_mixtral_adds_the_routers_aux_loss_to_its_loss(tmp_path, tiny_config, data_dir):
    """TRL's DPO on a Mixtral (configs/tiny-moe.yaml's rlhf is GRPO): its first step's policy is its reference (a frozen
    copy), so the sigmoid DPO loss is exactly log 2 and, without the SFT term (sft_weight 0), the step's loss is log 2
    plus the coefficient times the router's aux loss, logged as train/router_aux_loss. Dropping either fails."""
    import math

    from tasks.rlhf.config import RlhfConfig
    from tasks.rlhf.task import run_rlhf
    from tasks.stage import StageContext

    src = make_moe_checkpoint(tmp_path / "input", "mixtral", data_dir / "tokenizer")
    coef = json.loads((src / "config.json").read_text())["router_aux_loss_coef"]
    work = tmp_path / "rlhf"
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=work, work_dir=work, model=tiny_config.model.model_dump(),
                       seed=0, data_dir=data_dir, input=src, input_format="hf-safetensors")
    cfg = RlhfConfig(algorithm="dpo", steps=1, micro_batch_size=4, lr=1e-3, beta=0.1, sft_weight=0.0,
                     checkpoint_every=1000, timeout_s=600)
    run_rlhf.fn(ctx, cfg)
    (step,) = [m for m in logged_metrics(work) if events.TRAIN_LOSS in m]
    aux = step[events.TRAIN_ROUTER_AUX_LOSS]
    assert aux > 0 and step[events.TRAIN_LOSS] == pytest.approx(math.log(2) + coef * aux, rel=1e-5), step


def test_lora_on_a_mixture_of_experts_is_refused_before_launch_naming_the_key(tmp_path, tiny_config, data_dir):
    """peft's target_modules cannot reach transformers' fused experts: LoRA on an MoE input is refused before
    anything launches, naming the key; without LoRA the same input passes the checks."""
    from tasks.finetune.task import FinetuneInputError, check_inputs
    from tasks.stage import StageContext

    src = make_moe_checkpoint(tmp_path / "input", "mixtral", data_dir / "tokenizer")
    ctx = StageContext(stage="finetune", run_id="test", run_dir=tmp_path, work_dir=tmp_path,
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=src,
                       input_format="hf-safetensors")
    with pytest.raises(FinetuneInputError, match=r"finetune\.lora\.enabled: the input .* is a mixture of experts "
                                                 r"\(4 experts, config\.json\).*target_modules"):
        check_inputs(ctx, FinetuneConfig(lora={"enabled": True}))
    check_inputs(ctx, FinetuneConfig())


def test_exporting_a_mixture_of_experts_is_refused_before_anything_runs(tmp_path, data_dir, baton_home):
    """Neither `baton export` (a GGUF type, a quantization type) nor a run whose export stage would get an MoE
    launches a converter: the export gates know a dense model only (tasks/export/config.moe_problem: what they
    measured wrong on a Mixtral). Refused naming the checkpoint or export.types, nothing written."""
    src = make_moe_checkpoint(tmp_path / "mixtral", "mixtral", data_dir / "tokenizer")
    for kind in ("q8_0", "w8a8"):
        r = baton("export", str(src), str(tmp_path / kind), "--type", kind, "--calibration", str(data_dir),
                  home=baton_home, timeout=300)
        assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
        assert f"{src}: the model is a mixture of experts (4 experts)" in r.stderr, r.stderr
        assert not (tmp_path / kind).exists() and not list(tmp_path.glob(f"{kind}*partial*"))
    r = baton("config", str(REPO / "configs" / "tiny-moe.yaml"), "--set", "stages=[data,pretrain,export]",
              "--set", "export.types=[q8_0]", home=baton_home, timeout=300)
    assert r.returncode == 2 and "export.types: the model is a mixture of experts (4 experts)" in r.stderr, r.stderr
