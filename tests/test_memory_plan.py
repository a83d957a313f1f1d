"""`baton plan`: valid layouts for 8B and 70B, the refusal of 70B on one 24 GB GPU, formulas against their papers."""
from __future__ import annotations

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
