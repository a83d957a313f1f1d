"""Megatron-Core mixture-of-experts pretraining for real: torchrun on CPU (gloo), 4 experts top-2 in every layer,
expert parallel 2 with the all-gather and the all-to-all token dispatchers, a resume under another expert-parallel
size, and the conversion to HF Mixtral with its gate (logits parity against Megatron's own)."""
from __future__ import annotations

import shutil

import pytest

from test_pretrain_megatron import assert_trained, dist_tensors, losses, run_stage

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden_size=96",
       "model.moe.aux_loss_coef=0.01"]
EP2 = [*MOE, "pretrain.nproc_per_node=2", "pretrain.expert_parallel=2"]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, data_dir):
    work = tmp_path_factory.mktemp("moe-ep2")
    return work, run_stage(work, data_dir, *EP2)


def test_ep2_allgather_trains_checkpoints_and_holds_every_expert(ep2):
    work, out = ep2
    assert_trained(out)
    assert out.backend.startswith("TP1×PP1×DP2×EP2")
    log = (work / "engine.log").read_text()
    assert "EP=2 (allgather dispatcher)" in log
    shapes = {k: tuple(v.shape) for k, v in dist_tensors(out.output).items()}
    # each rank trained two of the four experts; the checkpoint holds all four of every layer, and the router
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 2 * 96, 128)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (4, 4, 128, 96)
    assert shapes["decoder.layers.mlp.router.weight"] == (4, 4, 128)
    assert "decoder.layers.mlp.linear_fc2.weight" not in shapes  # no dense MLP beside the experts
