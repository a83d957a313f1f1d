"""`baton plan`: valid layouts for 8B and 70B, the refusal of 70B on one 24 GB GPU, formulas against their papers."""
from __future__ import annotations

import json
from dataclasses import replace

import yaml
import pytest

from flows.cli import main as baton_main
from flows.config import PipelineConfig
from tasks import memory_plan as mp

pytestmark = pytest.mark.fast


def assert_valid(p: mp.Plan) -> None:
    s, lay, hw = p.shape, p.layout, p.hardware
    assert lay is not None, p.reason
    assert lay.tp <= hw.gpus_per_node, "TP stays within a node"
    assert s.heads % lay.tp == 0 and s.groups % lay.tp == 0 and s.ffn % lay.tp == 0
    assert s.layers % lay.pp == 0
    assert lay.tp * lay.pp * lay.dp == hw.world()
    assert lay.global_batch % (lay.micro_batch * lay.dp) == 0
    assert p.memory.total() <= hw.per_rank_bytes() / (1 + p.headroom)


def test_8b_on_one_node_of_eight_80gb_gpus():
    p = mp.plan(mp.shape_for_params(8e9), mp.Hardware(1, 8, 80))
    assert 7.9e9 < p.shape.params() < 8.1e9
    assert_valid(p)
    assert p.strategy.startswith("< 10B")


def test_70b_on_eight_nodes_of_eight_80gb_gpus():
    p = mp.plan(mp.shape_for_params(70e9), mp.Hardware(8, 8, 80))
    assert_valid(p)
    assert p.layout.tp == 8 and p.layout.pp > 1, "70B needs TP across the node and PP across nodes"
    assert p.strategy.startswith("30-100B")


def test_70b_on_one_24gb_gpu_is_refused_with_the_reason(capsys):
    rc = baton_main(["plan", "--params", "70e9", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "24"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "nothing fits" in out and "exceeds 20.0 GiB" in out and "largest part is" in out


def test_write_emits_a_block_the_config_accepts(capsys):
    rc = baton_main(["plan", "--params", "8e9", "--gpu-memory-gb", "80", "--write"])
    out = capsys.readouterr().out
    assert rc == 0
    block = yaml.safe_load(out[out.index("# baton plan:"):])
    cfg = PipelineConfig.model_validate({**block, "stages": ["data", "pretrain"]})
    assert cfg.pretrain.tensor_parallel * cfg.pretrain.data_parallel() == 8
    assert cfg.model.num_layers == 32


def test_explicit_shape_with_indivisible_heads_refuses_those_tp_sizes():
    p = mp.plan(mp.Shape(24, 2560, 20, 4, 6912, 32000), mp.Hardware(1, 8, 80), seq=2048)
    assert any(r.startswith("TP8: does not divide heads 20, query groups 4") for r in p.rejected)
    assert not any("TP16" in r for r in p.rejected)  # TP never leaves the node
    assert_valid(p)


def test_zero_paper_model_states():
    """ZeRO paper, Fig. 1: Ψ = 7.5B, N = 64, K = 12 → 120 GB baseline, 31.4 GB P_os, 16.6 GB P_os+g, 1.9 GB all."""
    psi = 7.5e9
    expect = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expect.items():
        w, g, o = mp.state_bytes_per_param(mp.Layout("finetune", dp=64, zero_stage=stage), "bf16")
        if stage == 0:
            o = 12
        assert psi * (w + g + o) / 1e9 == pytest.approx(gb, rel=0.02)


def test_megatron_distributed_optimizer_bytes():
    """Megatron-LM docs: bf16 params with fp32 grads take 18 bytes/param, 6 + 12/d with the distributed optimizer."""
    assert sum(mp.state_bytes_per_param(mp.Layout("pretrain", dp=8), "bf16")) == 18
    assert sum(mp.state_bytes_per_param(mp.Layout("pretrain", dp=8, distributed_optimizer=True), "bf16")) == 6 + 12 / 8


def test_activation_formulas_follow_the_recompute_paper():
    s = mp.Shape(32, 4096, 32, 32, 16384, 50000)  # MHA, f = 4h: attention + norms = 15 of the paper's 34
    assert mp.layer_activation_coefficient(s) - (3 + 6 * 4) == 15
    one = mp.layer_activation_bytes(s, 2048, mp.Layout("pretrain", tp=1, micro_batch=1), flash=True)
    sp8 = mp.layer_activation_bytes(s, 2048, mp.Layout("pretrain", tp=8, sequence_parallel=True), flash=True)
    assert sp8 == pytest.approx(one / 8)
    full = mp.layer_activation_bytes(s, 2048, mp.Layout("pretrain", recompute="full"), flash=False)
    assert full == 2 * 2048 * 4096
    scores = mp.layer_activation_bytes(s, 2048, mp.Layout("pretrain"), flash=False) - one
    assert scores == pytest.approx(5 * 32 * 2048 * 2048)  # 5·a·s²·b, gone with selective recompute or flash


def test_plan_of_the_tiny_config_fits_on_this_machine(capsys):
    assert baton_main(["plan", "configs/tiny.yaml"]) == 0
    out = capsys.readouterr().out
    assert "the configured layout" in out and "TP1 × PP1 × DP1" in out


# ---- mixtures of experts ------------------------------------------------------------------------------------------
MIXTRAL_8X7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--query-groups", "8", "--ffn", "14336",
                "--vocab", "32000", "--experts", "8", "--top-k", "2"]


def test_mixtral_8x7b_total_and_active_parameters_match_the_published_counts(capsys):
    """Mistral's published counts for Mixtral-8x7B: 46.7B parameters, 12.9B active per token."""
    import json

    rc = baton_main(["plan", *MIXTRAL_8X7B, "--stage", "finetune", "--json"])
    out = json.loads(capsys.readouterr().out)["search"]
    assert rc == 0
    assert round(out["parameters"] / 1e9, 1) == 46.7 and round(out["active_parameters"] / 1e9, 1) == 12.9
    # memory holds every expert: the weights' bytes follow the total, not the active count
    dense = mp.Shape(32, 4096, 32, 8, 14336, 32000)
    moe = mp.Shape(32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2, expert_ffn=14336)
    assert moe.params(active=True) < 0.3 * moe.params() and moe.params() > 5.5 * dense.params()
    lay = mp.Layout("finetune", dp=8, zero_stage=2)
    assert mp.breakdown(moe, lay, 4096, "bf16", "cuda").weights == 2 * moe.params()


def test_the_model_moe_section_is_planned_and_pretraining_its_shared_expert_is_refused(tmp_path, capsys):
    from flows.config import ConfigError, load

    cfg = tmp_path / "moe.yaml"
    cfg.write_text(yaml.safe_dump({"stages": ["data", "finetune"], "model": {
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 96, "shared_expert_ffn_hidden_size": 64}}}))
    baton_main(["plan", str(cfg)])
    out = capsys.readouterr().out
    assert "active per token (top-2 of 4 experts of ffn 96 and a shared expert of ffn 64)" in out, out
    shape = mp.shape_of_model(load(cfg).model)
    assert (shape.experts, shape.top_k, shape.expert_ffn, shape.shared_ffn) == (4, 2, 96, 64)
    with pytest.raises(ConfigError, match="shared_expert_ffn_hidden_size 64: Megatron pretraining here exports to "
                                          "Mixtral, which has no shared expert"):
        load(cfg, stages=["data", "pretrain"])
    with pytest.raises(ConfigError, match="top_k 5 is more than num_experts 4"):
        load(cfg, ["model.moe.top_k=5"])


@pytest.mark.parametrize("family, expected", [
    ("Qwen3MoeConfig", {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 48, "aux_loss_coef": 0.001}),
    ("Qwen2MoeConfig", {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 48,
                        "shared_expert_ffn_hidden_size": 80, "aux_loss_coef": 0.001}),
    ("MixtralConfig", {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 48, "aux_loss_coef": 0.001}),
])
def test_an_hf_moe_config_reads_into_model_moe_names(family, expected):
    """transformers' own config classes, saved as config.json, read back in model.moe's names (conversions.hf)."""
    import transformers

    from conversions import hf

    sizes = {"MixtralConfig": dict(num_local_experts=4, intermediate_size=48),
             "Qwen3MoeConfig": dict(num_experts=4, moe_intermediate_size=48, intermediate_size=96)}.get(
        family, dict(num_experts=4, moe_intermediate_size=48, intermediate_size=96, shared_expert_intermediate_size=80))
    config = getattr(transformers, family)(num_experts_per_tok=2, router_aux_loss_coef=0.001, **sizes).to_dict()
    found = hf.moe_of_hf_config(config)
    assert {k: found.get(k) for k in expected} == expected
    assert hf.moe_of_hf_config(transformers.LlamaConfig().to_dict()) is None


def test_expert_parallel_divides_the_routed_experts_weights_and_optimizer_per_rank(capsys):
    """configs/tiny-moe.yaml on its 2 CPU ranks (DP 2, fp32: 4 B weights, 4 B fp32 grads, 8 B Adam), counted by hand.
    Per layer: attention 128·(4 + 2·2)·32 + 4·32·128 = 49,152; router 128·4 = 512 (whole on every rank); norms 256;
    routed experts 4·3·128·172 = 264,192. Model: 4 layers · 314,112 + embedding and output 2·512·128 + final norm 128
    = 1,387,648. EP 2: each rank holds 2 of the 4 experts, 1,387,648 − 4·264,192/2 = 859,264 parameters."""
    from flows.config import load

    cfg = load("configs/tiny-moe.yaml", ["pretrain.distributed_optimizer=true"])
    shape = mp.shape_of_model(cfg.model)

    def states(ep: int) -> tuple:
        layout = replace(mp.layout_of_stage("pretrain", cfg.pretrain, "cpu"), ep=ep)
        b = mp.breakdown(shape, layout, 128, "fp32", "cpu")
        return b.extra["params_per_rank"], b.weights, b.gradients, b.optimizer

    assert states(1) == (1_387_648, 4 * 1_387_648, 4 * 1_387_648, 8 * 1_387_648 / 2)
    # EP 2: the 330,880 dense parameters' Adam state is sharded over DP 2, the experts' over DP / EP = 1
    assert states(2) == (859_264, 4 * 859_264, 4 * 859_264, 8 * 330_880 / 2 + 8 * 528_384)
    # the configured EP (2) is what `baton plan` counts and shows, and a planned block carries it
    assert baton_main(["plan", "configs/tiny-moe.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["configured"]
    assert out["layout"]["ep"] == 2
    assert baton_main(["plan", "configs/tiny-moe.yaml"]) == 0
    assert "TP1 × PP1 × DP2 (EP2)" in capsys.readouterr().out


def test_expert_tensor_parallel_1_keeps_whole_experts_under_tp():
    """EP2 × TP2 on tiny-moe's 2 ranks: with ETP 1 a rank holds 2 whole experts (TP splits only the dense part); at
    Megatron's default ETP = TP it would hold half of each, 1/(TP × EP). Routed experts per layer (see above):
    264,192, of which a rank holds half."""
    from flows.config import load

    cfg = load("configs/tiny-moe.yaml", ["pretrain.tensor_parallel=2", "pretrain.sequence_parallel=true",
                                         "pretrain.expert_tensor_parallel=1"])
    shape = mp.shape_of_model(cfg.model)
    layout = mp.layout_of_stage("pretrain", cfg.pretrain, "cpu")
    assert (layout.tp, layout.dp, layout.ep, layout.expert_tp()) == (2, 1, 2, 1)
    whole = mp.expert_params_per_rank(shape, layout)
    assert whole == 4 * 264_192 / 2
    assert mp.expert_params_per_rank(shape, replace(layout, etp=None)) == whole / 2
    assert "TP2 × PP1 × DP1 (EP2, ETP1)" in layout.describe()
    # the experts' Adam state is sharded over their data-parallel ranks: TP × DP / (ETP × EP) = 1, none to shard over
    b = mp.breakdown(shape, replace(layout, distributed_optimizer=True), 128, "fp32", "cpu")
    dense = b.extra["params_per_rank"] - whole
    assert b.optimizer == 8 * dense / 1 + 8 * whole


def test_the_search_splits_experts_before_it_splits_matrices():
    """An 8-layer, 4-expert model on one node of 4 GPUs (DP 4, distributed optimizer, bf16: weights 2 B, fp32 grads 4 B,
    Adam 12 B sharded). By hand: per layer attention 4096·48·128 + 4096² = 41.9M, experts 4·3·4096·14336 = 704.6M;
    embedding and output 2·32000·4096 = 262.1M; 6.24G parameters of which 5.64G routed experts, 0.60G the rest.
    EP 1: 6.24G · (2 + 4 + 12/4) = 56.1 GB. EP 2: (0.60G + 2.82G) · 6 + 0.60G · 12/4 + 2.82G · 12/2 = 39.2 GB.
    Activations and the CUDA allowance add ~3.5 GB, so a 45 GB budget fits EP 2 and not EP 1, at TP1 × PP1."""
    moe = mp.Shape(8, 4096, 32, 8, 14336, 32000, experts=4, top_k=2, expert_ffn=14336)
    p = mp.plan(moe, mp.Hardware(1, 4, 45e9 / 2**30, "cuda"), "pretrain", seq=1024, headroom=0.0)
    assert p.layout is not None, p.reason
    assert (p.layout.tp, p.layout.pp, p.layout.ep, p.layout.recompute) == (1, 1, 2, "none"), p.layout


def test_every_moe_layout_the_search_considers_is_one_the_pretrain_stage_accepts():
    """The planner proposes only expert layouts the stage would launch: with EP and TP, whole experts per rank
    (expert_tensor_parallel 1) and sequence parallel, written back by `baton plan --write` as the stage's keys."""
    from tasks.pretrain.config import expert_errors

    shape = mp.Shape(32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2, expert_ffn=14336)
    layouts = mp.candidate_layouts(shape, mp.Hardware(2, 8, 80), "pretrain", 1, None, [])
    assert any(lay.ep > 1 and lay.tp > 1 for lay in layouts)
    for lay in layouts:
        block = mp.stage_block(mp.Plan(shape, mp.Hardware(2, 8, 80), "pretrain", 4096, "bf16", 0.1, "", layout=lay))
        cfg = PipelineConfig.model_validate({"model": mp.model_block(shape, 4096)["model"], **block,
                                             "stages": ["data", "pretrain"]})
        assert expert_errors(cfg.pretrain, cfg.model) == [], (lay.describe(), block)
