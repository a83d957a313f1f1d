"""Pretrain stage checks that need no engine: config validation (tiny and GPU recipes), Megatron vocab padding, the
qkv layout, and the HF ⇄ Megatron conversion round trip on real random-init HF checkpoints (Llama and Qwen2), with
the architectures that do not map refused before launch."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, baton, make_hf_checkpoint, make_qwen2_checkpoint

RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))


def _errors(*overrides: str) -> str:
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(TINY, list(overrides), stages=["data", "pretrain"])
    return str(e.value)


def test_tiny_pretrain_config_is_valid():
    from flows.config import load

    cfg = load(TINY, stages=["data", "pretrain"])
    assert cfg.pretrain.data_parallel() == 1 and cfg.pretrain.world_size() == 1


EP2_TP2_ON_2 = ["model.moe.num_experts=4", "pretrain.expert_parallel=2", "pretrain.tensor_parallel=2",
                "pretrain.sequence_parallel=true", "pretrain.nproc_per_node=2"]


@pytest.mark.parametrize("overrides, message", [
    (["pretrain.tensor_parallel=3"], "num_attention_heads 4 is not divisible"),
    (["model.num_query_groups=1", "pretrain.tensor_parallel=2", "pretrain.nproc_per_node=2"],
     "num_query_groups 1 is not divisible"),
    (["pretrain.pipeline_parallel=3", "pretrain.nproc_per_node=1"], "num_layers 4 is not divisible"),
    (["pretrain.global_batch_size=12", "pretrain.micro_batch_size=8"], "global_batch_size 12 is not divisible by"),
    (["pretrain.nproc_per_node=2", "pretrain.global_batch_size=8", "pretrain.micro_batch_size=8"],
     "global_batch_size 8 is not divisible by micro_batch_size 8 × data parallel 2"),
    (["pretrain.nproc_per_node=64", "pretrain.global_batch_size=512"], "more ranks than it can host"),
    (["pretrain.tensor_parallel=2", "pretrain.pipeline_parallel=2", "pretrain.nproc_per_node=2"],
     "not a multiple of tensor_parallel × pipeline_parallel = 4"),
    (["pretrain.vocab_size=300"], "smaller than the tokenizer's vocabulary"),
    (["pretrain.max_seq_length=256"], "exceeds model.seq_length 128"),
    (["pretrain.sequence_parallel=true"], "sequence_parallel needs tensor_parallel > 1"),
    (["pretrain.warmup_steps=100", "pretrain.steps=50"], "warmup_steps 100 must be below steps 50"),
    (["pretrain.micro_batch_size=0"], "pretrain.micro_batch_size"),
    (["pretrain.unknown_knob=1"], "pretrain.unknown_knob: unknown key"),
    (["pretrain.expert_parallel=2", "pretrain.nproc_per_node=2"],
     "pretrain.expert_parallel 2 needs model.moe (a dense model has no experts to split)"),
    (["model.moe.num_experts=3", "pretrain.expert_parallel=2", "pretrain.nproc_per_node=2"],
     "pretrain.expert_parallel 2: model.moe.num_experts 3 is not divisible by it"),
    (["model.moe.num_experts=4", "pretrain.expert_parallel=2"],
     "pretrain.expert_parallel 2: 1 ranks are not a multiple of expert_parallel 2 × expert_tensor_parallel 1 "
     "(tensor_parallel, the default) × pipeline_parallel 1 = 2"),
    (["model.moe.num_experts=4", "model.moe.expert_ffn_hidden_size=45", "pretrain.tensor_parallel=2",
      "pretrain.nproc_per_node=2"], "pretrain.expert_tensor_parallel 2: the experts' FFN width 45 is not divisible"),
    (["model.moe.num_experts=4", "pretrain.tensor_parallel=2", "pretrain.nproc_per_node=2"],
     "pretrain.sequence_parallel must be true with model.moe and tensor_parallel 2"),
    (EP2_TP2_ON_2, "pretrain.expert_tensor_parallel 2: 2 ranks are not a multiple of expert_parallel 2 × "
                   "expert_tensor_parallel 2 (tensor_parallel, the default) × pipeline_parallel 1 = 4"),
    ([*EP2_TP2_ON_2, "pretrain.nproc_per_node=4", "pretrain.expert_tensor_parallel=2"],
     "pretrain.expert_tensor_parallel 2 with expert_parallel 2: not supported here"),
    ([*EP2_TP2_ON_2, "pretrain.expert_tensor_parallel=3"],
     "pretrain.expert_tensor_parallel 3: not supported here; 1 or tensor_parallel 2"),
    (["pretrain.expert_tensor_parallel=2"], "pretrain.expert_tensor_parallel 2 needs model.moe"),
    (["model.moe.num_experts=4", "pretrain.expert_parallel=2", "pretrain.pipeline_parallel=2",
      "pretrain.nproc_per_node=2"], "pretrain.expert_parallel 2: 2 ranks are not a multiple of expert_parallel 2 × "
                                    "expert_tensor_parallel 1 (tensor_parallel, the default) × pipeline_parallel 2"),
])
def test_bad_layouts_are_named_before_launch(overrides, message):
    assert message in _errors(*overrides)


def test_ep2_tp2_on_2_ranks_with_whole_experts_is_valid():
    from flows.config import load

    cfg = load(TINY, [*EP2_TP2_ON_2, "pretrain.expert_tensor_parallel=1"], stages=["data", "pretrain"])
    assert cfg.pretrain.data_parallel() == 1 and cfg.pretrain.expert_tensor_parallel == 1


def test_plan_refuses_an_expert_layout_megatron_cannot_lay_out(baton_home):
    """`baton plan` skips the run's host checks (it plans for other hardware) but not an expert grid that cannot
    exist: exit 2, the key named, as `baton run` would refuse it."""
    args = [f"--set={o}" for o in EP2_TP2_ON_2]
    r = baton("plan", str(TINY), "--stage", "pretrain", *args, home=baton_home, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "baton plan: pretrain.expert_tensor_parallel 2: 2 ranks are not a multiple of expert_parallel 2" in r.stderr
    ok = baton("plan", str(TINY), "--stage", "pretrain", *args, "--set=pretrain.expert_tensor_parallel=1",
               "--cpu", home=baton_home, timeout=120)
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
    assert "TP2 × PP1 × DP1 (EP2, ETP1)" in ok.stdout, ok.stdout


def test_cli_rejects_a_bad_layout_in_about_a_second(baton_home):
    t0 = time.time()
    r = baton("run", str(TINY), "--stages", "data,pretrain", "--set", "pretrain.tensor_parallel=3",
              home=baton_home, timeout=120)
    seconds = time.time() - t0
    assert r.returncode == 2, r.stderr
    assert "pretrain.tensor_parallel 3: model.num_attention_heads 4 is not divisible by it" in r.stderr
    assert not (baton_home / "runs").exists()  # nothing was launched
    assert seconds < 60, seconds  # no Prefect, MLflow or engine started (≈1-5 s; generous for a busy machine)


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_gpu_recipes_validate_on_their_target_hardware(recipe, monkeypatch):
    """The recipes are consistent layouts: on a host with 8 visible GPUs every check passes; here (no GPU) the only
    complaints are that the machine cannot host the ranks and lacks the cluster's data files."""
    from flows.config import ConfigError, PipelineConfig, load
    from tasks.pretrain.config import validate

    raw = yaml.safe_load(recipe.read_text())
    cfg = PipelineConfig.model_validate(raw)
    p, m = cfg.pretrain, cfg.model
    assert p.device == "cuda" and p.precision == "bf16" and p.distributed_optimizer
    assert p.overlap_grad_reduce and p.overlap_param_gather and p.recompute_granularity == "selective"
    assert p.data_parallel() * p.tensor_parallel * p.pipeline_parallel == p.world_size()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(p.nproc_per_node)))
    assert validate(p, cfg) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as e:
        load(recipe)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert any("GPU(s); more ranks than it can host" in line for line in lines), lines
    assert all("GPU(s); more ranks than it can host" in line or line.startswith("data.") and "matches no file" in line
               for line in lines), lines
    assert m.num_layers % p.pipeline_parallel == 0 and m.num_attention_heads % p.tensor_parallel == 0


def test_recipe_layouts():
    shapes = {p.stem: yaml.safe_load(p.read_text())["pretrain"] for p in RECIPES}
    eight_b = shapes["llama3-8b-8xh100"]
    assert (eight_b["tensor_parallel"], eight_b["pipeline_parallel"], eight_b["nproc_per_node"], eight_b["nnodes"]) == (2, 1, 8, 1)
    seventy_b = shapes["llama3-70b-8x8xh100"]
    assert (seventy_b["tensor_parallel"], seventy_b["pipeline_parallel"], seventy_b["nnodes"]) == (8, 4, 8)


def test_megatron_vocab_padding_rule():
    from conversions.megatron import padded_vocab_size

    assert padded_vocab_size(502) == 512
    assert padded_vocab_size(503, 128, 2) == 512
    assert padded_vocab_size(128256) == 128256 and padded_vocab_size(128256, 128, 8) == 129024
    assert padded_vocab_size(50257, 128, 8) == 51200


def test_qkv_split_is_per_query_group_and_inverts_merge():
    import torch

    from conversions.megatron import merge_qkv, split_qkv

    heads, groups, d, h = 8, 2, 4, 16
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    fused = merge_qkv(q, k, v, heads, groups, d)
    # Megatron's layout: for each group, its 4 query heads, then its key head, then its value head
    assert torch.equal(fused[: 4 * d], q[: 4 * d]) and torch.equal(fused[4 * d: 5 * d], k[:d])
    assert torch.equal(fused[5 * d: 6 * d], v[:d]) and torch.equal(fused[6 * d: 10 * d], q[4 * d: 8 * d])
    q2, k2, v2 = split_qkv(fused, heads, groups, d)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_to_megatron_to_hf_is_exact(tmp_path, tiny_config, data_dir, tie):
    """HF → Megatron dist checkpoint (padded vocab, fused qkv, [gate; up]) → HF gives back every tensor bit for bit,
    tied or not, with the tokenizer's vocabulary and the chat template."""
    import torch

    from conversions import hf, megatron, probe

    src = make_hf_checkpoint(tmp_path / "hf", tiny_config.model.model_dump(), data_dir / "tokenizer", seed=3, tie=tie)
    mid, back = tmp_path / "megatron", tmp_path / "back"
    info = megatron.from_hf(src, mid, max_shard_bytes=1 << 20)
    vocab = info["vocab_size"]
    assert info["padded_vocab_size"] == megatron.padded_vocab_size(vocab) > vocab
    assert megatron.is_dist_checkpoint(mid) and (mid / "tokenizer" / "chat_template.jinja").exists()
    assert (mid / probe.PROBE_FILE).exists()  # the HF model's logits, for whoever loads this into Megatron
    reader = megatron.DistReader(mid)
    assert reader.shape(megatron.EMBEDDING) == (info["padded_vocab_size"], 128)
    assert (reader.shape(megatron.OUTPUT) is None) == tie
    assert reader.shape(megatron.LAYER["qkv"]) == (4, (4 + 2 * 2) * 32, 128)

    out = megatron.to_hf(mid, back, max_shard_bytes=1 << 20)
    assert out["padding_rows_removed"] == info["padded_vocab_size"] - vocab
    original, converted = hf.load_state_dict(src), hf.load_state_dict(back)
    if tie:
        original.pop("lm_head.weight", None)
    assert set(original) == set(converted)
    for name, t in original.items():
        assert torch.equal(t, converted[name]), name
    cfg = (back / "config.json").read_text()
    assert f'"vocab_size": {vocab}' in cfg and f'"tie_word_embeddings": {str(tie).lower()}' in cfg
    assert json.loads(cfg)["architectures"] == ["LlamaForCausalLM"]
    assert (back / "chat_template.jinja").exists()


def test_qkv_bias_fuses_per_query_group_as_megatron_splits_it():
    """Megatron-Core's Attention.get_query_key_value_tensors views linear_qkv's output (bias included) as
    [groups, (heads/groups + 2) · head_dim]: q1 q2 k1 v1 | q3 q4 k2 v2 for 4 heads in 2 groups."""
    import torch

    from conversions.megatron import merge_qkv, split_qkv

    heads, groups, d = 4, 2, 3
    q, k, v = torch.randn(heads * d), torch.randn(groups * d), torch.randn(groups * d)
    fused = merge_qkv(q, k, v, heads, groups, d)
    assert torch.equal(fused, torch.cat([q[: 2 * d], k[:d], v[:d], q[2 * d:], k[d:], v[d:]]))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups, d), (q, k, v)))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_qwen2_to_megatron_and_back_keeps_its_biases_and_logits(tmp_path, tiny_config, data_dir, tie):
    """Qwen2 (GQA, random q/k/v biases) → Megatron: the biases land fused per query group in linear_qkv.bias, and come
    back bit for bit into a Qwen2ForCausalLM config.json that transformers loads with the original's logits."""
    import torch

    from conversions import hf, megatron, probe

    src = make_qwen2_checkpoint(tmp_path / "qwen2", tiny_config.model.model_dump(), data_dir / "tokenizer", seed=5,
                                tie=tie)
    mid, back = tmp_path / "megatron", tmp_path / "back"
    info = megatron.from_hf(src, mid, max_shard_bytes=1 << 20)
    assert info["architecture"]["arch"] == "qwen2" and megatron.architecture(mid)["arch"] == "qwen2"
    original = hf.load_state_dict(src)
    layer1 = [original[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"]
    assert all(b.abs().min() > 0 for b in layer1)  # the premise: nothing to lose would prove nothing
    fused = megatron.DistReader(mid).read_full(megatron.QKV_BIAS)
    assert fused.shape == (4, (4 + 2 * 2) * 32)
    q, k, v = layer1  # group g: its two query heads, its key head, its value head
    assert torch.equal(fused[1], torch.cat([q[:64], k[:32], v[:32], q[64:], k[32:], v[32:]]))

    megatron.to_hf(mid, back, max_shard_bytes=1 << 20)
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is tie
    converted = hf.load_state_dict(back)
    if tie:
        original.pop("lm_head.weight", None)
    assert set(converted) == set(original)
    for name, t in original.items():
        assert torch.equal(t, converted[name]), name
    ids, reference = probe.load_reference(mid / probe.PROBE_FILE)  # the original model's logits, taken by from_hf
    assert torch.equal(probe.hf_logits(back, ids, "float32"), reference)


def _prepare_error(ckpt: Path, *overrides: str) -> str:
    from flows.config import ConfigError, load
    from flows.pipeline import prepare

    with pytest.raises(ConfigError) as e:
        prepare(load(TINY, list(overrides), stages=["pretrain"]), str(ckpt))
    return str(e.value)


def _with_manifest(ckpt: Path) -> Path:
    from conversions import hf, manifest as mf

    mf.write(ckpt, mf.build(ckpt, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(ckpt),
                            dtype="float32"))
    return ckpt


def test_a_qwen2_model_pretrains_only_as_model_arch_qwen2_and_without_sliding_windows(tmp_path, tiny_config,
                                                                                      data_dir):
    """Before launch: the config must name the input's family (Megatron's GPT is built from model:), and a Qwen2 with
    sliding-window layers is refused (Megatron's GPT here attends to the whole context)."""
    from flows.config import load
    from flows.pipeline import prepare

    ckpt = _with_manifest(make_qwen2_checkpoint(tmp_path / "qwen2", tiny_config.model.model_dump(),
                                                data_dir / "tokenizer"))
    _, _, steps = prepare(load(TINY, ["model.arch=qwen2"], stages=["pretrain"]), str(ckpt))
    assert [s.label for s in steps][1:3] == ["convert-hf-to-megatron", "pretrain"]
    assert (f"--from {ckpt}: stage 'convert-hf-to-megatron': architecture ['Qwen2ForCausalLM'] is the qwen2 family, "
            "the config's model.arch is llama (set model.arch: qwen2)") in _prepare_error(ckpt)

    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 64}))
    assert "with sliding-window layers: Megatron's GPT here attends to the full context" in _prepare_error(
        _with_manifest(ckpt), "model.arch=qwen2")


def test_to_hf_refuses_a_folder_that_is_not_a_dist_checkpoint(tmp_path, hf_checkpoint):
    from conversions import megatron

    with pytest.raises(megatron.MegatronCheckpointError, match="not a Megatron torch_dist checkpoint"):
        megatron.to_hf(hf_checkpoint, tmp_path / "out")


def test_from_hf_refuses_a_llama_whose_biases_it_would_drop(tmp_path, hf_checkpoint):
    import shutil

    from conversions import megatron

    src = tmp_path / "llama-with-biases"
    shutil.copytree(hf_checkpoint, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(megatron.MegatronCheckpointError, match="with attention_bias/mlp_bias: the Llama mapping has "
                                                               "no biases to carry them"):
        megatron.from_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gpt2", {"x": 1}, 5])
def test_a_checkpoint_naming_a_family_baton_does_not_map_is_refused(tmp_path, family):
    import torch

    from conversions import megatron

    arch = {"arch": family, "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 8,
            "vocab_size": 300}
    torch.save({megatron.ARCH_KEY: arch}, str(tmp_path / megatron.COMMON_FILE))
    with pytest.raises(megatron.MegatronCheckpointError,
                       match=re.escape(f"architecture family {family!r} is not one baton maps (llama, qwen2, qwen3)")):
        megatron.architecture(tmp_path)


def test_pretrain_refuses_an_input_of_another_family_than_model_arch(tmp_path, tiny_config, data_dir):
    """A Qwen2 import into a llama model (its biases would have no place) is named before the worker starts."""
    from conversions import megatron
    from tasks.pretrain.task import PretrainInputError, build_spec
    from tasks.stage import StageContext

    src = make_qwen2_checkpoint(tmp_path / "qwen2", tiny_config.model.model_dump(), data_dir / "tokenizer",
                                tie=False)
    megatron.from_hf(src, tmp_path / "megatron")

    def spec(arch: str):
        ctx = StageContext(stage="pretrain", run_id="t", run_dir=tmp_path, work_dir=tmp_path / "w", seed=0,
                           model={**tiny_config.model.model_dump(), "arch": arch}, data_dir=data_dir,
                           input=tmp_path / "megatron", input_format="megatron-dist")
        return build_spec(ctx, tiny_config.pretrain)

    assert spec("qwen2").architecture["arch"] == "qwen2"
    with pytest.raises(PretrainInputError, match="architecture differs from model: arch qwen2 \\(input\\) vs llama "
                                                 "\\(model\\)"):
        spec("llama")
