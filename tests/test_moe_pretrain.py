"""Megatron-Core mixture-of-experts pretraining for real: torchrun on CPU (gloo), 4 experts top-2 in every layer,
expert parallel 2 with the all-gather and the all-to-all token dispatchers, a resume under another expert-parallel
size, EP combined with tensor parallel (EP2 × TP2 on 2 ranks) and pipeline parallel (EP2 × PP2 on 4 ranks), and the
conversion to HF Mixtral with its gate (logits parity against Megatron's own)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_pretrain_megatron import assert_trained, dist_tensors, losses, run_stage

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden_size=96",
       "model.moe.aux_loss_coef=0.01"]
EP2 = [*MOE, "pretrain.nproc_per_node=2", "pretrain.expert_parallel=2"]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, data_dir):
    work = tmp_path_factory.mktemp("moe-ep2")
    return work, run_stage(work, data_dir, *EP2)


# every training step routes each of its 16 sequences × 128 tokens (configs/tiny.yaml) to top-2 experts, in each layer
ROUTED_PER_LAYER_AND_STEP = 16 * 128 * 2


def logged(work: Path, name: str) -> dict[int, float]:
    out = {}
    for line in (work / "engine.log").read_text().splitlines():
        if line.startswith("@@baton ") and name in line:
            e = json.loads(line[len("@@baton "):])
            out[e["step"]] = e[name]
    return out


def router_aux_losses(work: Path) -> dict[int, float]:
    from tasks import events

    return logged(work, events.TRAIN_ROUTER_AUX_LOSS)


def assert_expert_load(out, steps: int) -> None:
    """The routers' tokens per expert over the run: every layer's counts sum to the tokens trained × top-k (evaluation
    and the probe forward passes not counted), in whole tokens, and the summary's imbalance is the largest count over
    the layer's mean."""
    tokens = out.extra["expert_tokens"]
    assert list(tokens) == ["layer_1", "layer_2", "layer_3", "layer_4"], tokens
    for layer, counts in tokens.items():
        assert len(counts) == 4 and all(isinstance(n, int) and n >= 0 for n in counts), (layer, counts)
        assert sum(counts) == steps * ROUTED_PER_LAYER_AND_STEP, (layer, counts)
    worst = max(max(c) / (steps * ROUTED_PER_LAYER_AND_STEP / 4) for c in tokens.values())
    assert out.metrics["expert_load_imbalance"] == pytest.approx(worst)
    assert out.metrics["idle_experts"] == sum(n == 0 for c in tokens.values() for n in c)


def test_ep2_allgather_trains_checkpoints_and_holds_every_expert(ep2):
    from tasks import events

    work, out = ep2
    assert_trained(out)
    assert out.backend.startswith("TP1×PP1×DP2×EP2")
    log = (work / "engine.log").read_text()
    assert "EP=2 ETP=1 (allgather dispatcher)" in log
    shapes = {k: tuple(v.shape) for k, v in dist_tensors(out.output).items()}
    # each rank trained two of the four experts; the checkpoint holds all four of every layer, and the router
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 2 * 96, 128)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (4, 4, 128, 96)
    assert shapes["decoder.layers.mlp.router.weight"] == (4, 4, 128)
    assert "decoder.layers.mlp.linear_fc2.weight" not in shapes  # no dense MLP beside the experts
    aux = router_aux_losses(work)
    # every step logs the routers' load-balancing loss; 1.0 is a perfectly balanced router, E (4) one expert for all
    assert sorted(aux) == list(range(1, 13)) and all(0.9 < a < 4.0 for a in aux.values()), aux
    # each step's load imbalance: 1 when every expert gets the same tokens, 4 (the experts) when one gets them all
    imbalance = logged(work, events.TRAIN_EXPERT_LOAD_IMBALANCE)
    assert sorted(imbalance) == list(range(1, 13)) and all(1.0 <= v <= 4.0 for v in imbalance.values()), imbalance
    assert_expert_load(out, steps=12)
    # the counts as a plot for the stage's MLflow run (tests/test_moe_chain.py finds it there)
    assert out.artifacts == [work / "expert_load.png"] and out.artifacts[0].read_bytes()[:4] == b"\x89PNG"


def test_resume_under_expert_parallel_1_continues_the_ep2_run(tmp_path, data_dir, ep2):
    """The EP2 run's checkpoint of step 8 resumed on the same 2 ranks without expert parallel (every rank holds all
    four experts): Megatron reshards the experts, and steps 9-12 train as the uninterrupted EP2 run did. Not bit for
    bit: EP2 sums an expert's gradient over both ranks' tokens in one matmul, DP2 all-reduces two halves."""
    work, out = ep2
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(work / "checkpoints" / "iter_0000008", tmp_path / "checkpoints" / "iter_0000008")
    resumed = run_stage(tmp_path, data_dir, *MOE, "pretrain.nproc_per_node=2", "pretrain.expert_parallel=1")
    assert resumed.metrics["resumed_from_step"] == 8 and resumed.backend.startswith("TP1×PP1×DP2 ")
    assert_expert_load(resumed, steps=12)  # steps 1-8's counts come back with the checkpoint
    assert "resumed from iter_0000008" in (tmp_path / "engine.log").read_text()
    before, after = losses(work), losses(tmp_path)
    assert sorted(after) == [9, 10, 11, 12]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-4), (step, after[step], before[step])
    a, b = dist_tensors(resumed.output), dist_tensors(out.output)
    weights = [k for k in a if not k.startswith("chained_")]
    diff = max((a[k] - b[k]).abs().max().item() for k in weights)
    print(f"EP2 → EP1 resume: max |Δweight| after 4 steps {diff:.3g}")
    assert diff < 1e-6  # 1.1e-8 measured


@pytest.mark.long  # ~35 s: the all-gather dispatcher at EP2 stays in `make test`
def test_ep2_alltoall_dispatcher_trains_as_the_allgather_one(tmp_path, data_dir, ep2):
    """The all-to-all dispatcher (CUDA side streams and host split sizes, both given their CPU meaning by the shim)
    sends every token to the same experts as the all-gather one: the same losses, step by step."""
    work, _ = ep2
    out = run_stage(tmp_path, data_dir, *EP2, "pretrain.moe_token_dispatcher=alltoall")
    assert_trained(out)
    assert "EP=2 ETP=1 (alltoall dispatcher)" in (tmp_path / "engine.log").read_text()
    allgather, alltoall = losses(work), losses(tmp_path)
    assert sorted(alltoall) == sorted(allgather) == list(range(1, 13))
    for step in alltoall:
        assert alltoall[step] == pytest.approx(allgather[step], rel=1e-5), step


EP2_TP2 = [*EP2, "pretrain.tensor_parallel=2", "pretrain.sequence_parallel=true", "pretrain.expert_tensor_parallel=1"]


@pytest.fixture(scope="module")
def ep2_tp2(tmp_path_factory, data_dir):
    work = tmp_path_factory.mktemp("moe-ep2-tp2")
    return work, run_stage(work, data_dir, *EP2_TP2)


@pytest.mark.long  # ~35 s
def test_ep2_with_tensor_parallel_2_trains_as_ep2_alone(ep2, ep2_tp2):
    """EP2 × TP2 on the same 2 ranks (attention and the router split over TP with sequence parallel, each rank
    holding two whole experts: expert tensor parallel 1): the same losses as EP2 over data parallel, step by step.
    The norms' weights see half the sequence per rank; their gradients are summed over TP (sequence_parallel_norm),
    without which the losses part from step 2 on."""
    work, out = ep2_tp2
    assert_trained(out)
    assert out.backend.startswith("TP2×PP1×DP1×EP2(ETP1)"), out.backend
    assert "TP=2 PP=1 DP=1 EP=2 ETP=1" in (work / "engine.log").read_text()
    assert_expert_load(out, steps=12)
    alone, with_tp = losses(ep2[0]), losses(work)
    assert sorted(with_tp) == sorted(alone) == list(range(1, 13))
    diff = max(abs(with_tp[s] - alone[s]) for s in alone)
    print(f"EP2×TP2 vs EP2: max |Δloss| over 12 steps {diff:.3g}")
    assert diff < 1e-5
    assert_exports_to_mixtral(out.output, work / "convert")


def run_on_more_ranks_than_cores(work: Path, data: Path, *overrides: str):
    """The stage as run_stage runs it, on 4 ranks: more than this 2-core machine's one rank per core (the check
    against this machine is skipped; the ranks share the cores, slower, the same arithmetic)."""
    from flows.config import load
    from tasks.pretrain.task import run_pretrain
    from tasks.stage import StageContext
    from conftest import TINY
    from test_pretrain_megatron import SHORT

    cfg = load(TINY, [*SHORT, *overrides], stages=["data", "pretrain"], host=False)
    ctx = StageContext(stage="pretrain", run_id="test", run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=0, data_dir=data)
    return run_pretrain.fn(ctx, cfg.pretrain)


EP2_PP2 = [*MOE, "pretrain.nproc_per_node=4", "pretrain.expert_parallel=2", "pretrain.pipeline_parallel=2"]


def from_step_8_of(ep2, work: Path) -> None:
    (work / "checkpoints").mkdir()
    shutil.copytree(ep2[0] / "checkpoints" / "iter_0000008", work / "checkpoints" / "iter_0000008")


def assert_continues_ep2(ep2, work: Path, resumed, weights_within: float) -> float:
    """Steps 9-12 of a run resumed from the EP2 run's step 8 train as the EP2 run did: the same losses and, after
    them, the same weights (not bit for bit: the layouts sum the same products in other orders)."""
    assert resumed.metrics["resumed_from_step"] == 8
    assert_expert_load(resumed, steps=12)
    before, after = losses(ep2[0]), losses(work)
    assert sorted(after) == [9, 10, 11, 12]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-5), (step, after[step], before[step])
    a, b = dist_tensors(resumed.output), dist_tensors(ep2[1].output)
    weights = [k for k in b if not k.startswith("chained_")]
    assert set(weights) <= set(a)
    diff = max((a[k] - b[k]).abs().max().item() for k in weights)
    assert diff < weights_within, diff
    return diff


@pytest.fixture(scope="module")
def ep2_pp2(tmp_path_factory, data_dir, ep2):
    """The EP2 run's checkpoint of step 8, resumed as EP2 × PP2 on 4 ranks. From a checkpoint, not from scratch:
    Megatron initialises each pipeline stage's layers from its own seed, so a fresh PP2 model is another model."""
    work = tmp_path_factory.mktemp("moe-ep2-pp2")
    from_step_8_of(ep2, work)
    return work, run_on_more_ranks_than_cores(work, data_dir, *EP2_PP2)


@pytest.mark.long  # ~60 s: 4 ranks on 2 cores
def test_ep2_checkpoint_resumes_as_ep2_with_pipeline_parallel_2_on_4_ranks(ep2, ep2_pp2):
    """EP2 × PP2 (2 layers per stage, each stage's 2 data-parallel ranks splitting its layers' experts) continues the
    EP2 run: Megatron reshards its checkpoint over the stages, steps 9-12 train as on 2 ranks, and the checkpoint it
    writes holds every expert of the 4 layers."""
    work, out = ep2_pp2
    assert_trained(out)
    assert out.backend.startswith("TP1×PP2×DP2×EP2"), out.backend
    assert "TP=1 PP=2 DP=2 EP=2 ETP=1" in (work / "engine.log").read_text()
    shapes = {k: tuple(v.shape) for k, v in dist_tensors(out.output).items()}
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 2 * 96, 128)
    diff = assert_continues_ep2(ep2, work, out, weights_within=1e-6)
    print(f"EP2 → EP2×PP2 resume: max |Δweight| after 4 steps {diff:.3g}")
    assert_exports_to_mixtral(out.output, work / "convert")


def test_ep2_checkpoint_resumes_as_ep2_with_tensor_parallel_2(tmp_path, data_dir, ep2):
    """The EP2 checkpoint of step 8 resumed as EP2 × TP2 on the same 2 ranks (attention split over TP, whole experts
    per rank): steps 9-12 as the uninterrupted EP2 run."""
    from_step_8_of(ep2, tmp_path)
    resumed = run_stage(tmp_path, data_dir, *EP2_TP2)
    assert resumed.backend.startswith("TP2×PP1×DP1×EP2(ETP1)"), resumed.backend
    diff = assert_continues_ep2(ep2, tmp_path, resumed, weights_within=1e-6)
    print(f"EP2 → EP2×TP2 resume: max |Δweight| after 4 steps {diff:.3g}")


def convert_stage(src: Path, work: Path):
    """The pipeline's convert step from the pretrain stage's checkpoint to HF, its gate included."""
    from flows.config import load
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert
    from tasks.stage import StageContext
    from conftest import TINY

    cfg = load(TINY, MOE, stages=["data", "pretrain"])
    ctx = StageContext(stage="convert", run_id="test", run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=0, input=src, input_format="megatron-dist",
                       extra={"from_format": "megatron-dist", "to_format": "hf-safetensors", "source_stage": "pretrain"})
    return run_convert.fn(ctx, ConvertConfig())


def assert_exports_to_mixtral(checkpoint: Path, work: Path) -> None:
    """A layout's checkpoint goes through the convert step to HF Mixtral with every gate check passed."""
    work.mkdir()
    out = convert_stage(checkpoint, work)
    assert out.gate["passed"], json.dumps(out.gate, indent=1)
    assert {"L1.source_tensors", "L2.logits_parity"} <= {c["name"] for c in out.gate["checks"]}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, ep2):
    work = tmp_path_factory.mktemp("moe-convert")
    return work, convert_stage(ep2[1].output, work)


def test_the_ep2_checkpoint_converts_to_mixtral_and_its_gate_passes_with_megatrons_logits(mixtral):
    from transformers import AutoConfig

    from conversions import hf

    work, out = mixtral
    assert out.gate["passed"], json.dumps(out.gate, indent=1)
    checks = {c["name"]: c for c in out.gate["checks"]}
    assert checks["L2.logits_parity"]["passed"], checks["L2.logits_parity"]["detail"]
    config = AutoConfig.from_pretrained(str(out.output))
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 96)
    shapes = hf.tensor_shapes(out.output)
    assert shapes["model.layers.3.block_sparse_moe.gate.weight"][1] == [4, 128]
    assert shapes["model.layers.3.block_sparse_moe.experts.3.w1.weight"][1] == [96, 128]
    assert shapes["model.layers.3.block_sparse_moe.experts.3.w2.weight"][1] == [128, 96]
    assert not any(".mlp." in name for name in shapes)
    source = checks["L1.source_tensors"]
    assert source["passed"] and source["detail"].startswith(f"{len(shapes)} tensors equal the source's"), source


def swap_experts_0_and_1(t: dict) -> None:
    for w in ("w1", "w2", "w3"):
        a, b = (f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1))
        t[a], t[b] = t[b], t[a]


def transpose_an_expert(t: dict) -> None:
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    t[name] = t[name].T.contiguous()


@pytest.mark.parametrize("fault, named", [
    (swap_experts_0_and_1, "model.layers.0.block_sparse_moe.experts.0.w1.weight: differs from the source (holds the "
                           "source's model.layers.0.block_sparse_moe.experts.1.w1.weight: tensors in the wrong order)"),
    (transpose_an_expert, "model.layers.1.block_sparse_moe.experts.2.w2.weight: transposed (shape (96, 128), the "
                          "source's (128, 96))"),
])
def test_a_faulty_export_fails_the_gate_naming_the_expert(tmp_path, ep2, mixtral, fault, named):
    """The export as a faulty converter would write it (experts swapped, an expert transposed): the gate fails, the
    tensor named, and the swap also breaks logits parity with Megatron's own."""
    from tasks.convert.task import gate
    from test_moe import faulty_copy

    bad = faulty_copy(mixtral[1].output, tmp_path / "faulty", fault)
    g = gate(bad, ep2[1].output, "hf-safetensors")
    checks = {c["name"]: c for c in g["checks"]}
    assert not g["passed"] and not checks["L1.source_tensors"]["passed"]
    assert named in checks["L1.source_tensors"]["detail"], checks["L1.source_tensors"]["detail"]
    if fault is swap_experts_0_and_1:
        assert not checks["L2.logits_parity"]["passed"], checks["L2.logits_parity"]["detail"]


def test_mixtral_back_to_megatron_is_exact(tmp_path, ep2, mixtral):
    """Megatron → Mixtral → Megatron: every weight of the trained checkpoint comes back bit for bit (the embedding's
    padding rows past the tokenizer's vocabulary are dropped on export and zero on import)."""
    from conversions import megatron

    back = tmp_path / "megatron"
    info = megatron.from_hf(mixtral[1].output, back, max_shard_bytes=1 << 20)
    assert info["architecture"]["moe"] == {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 96,
                                           "aux_loss_coef": 0.01}
    original, returned = dist_tensors(ep2[1].output), dist_tensors(back)
    weights = {k: v for k, v in original.items() if not k.startswith("chained_")}
    assert set(returned) == set(weights)
    vocab = info["vocab_size"]
    for key, t in weights.items():
        if key in (megatron.EMBEDDING, megatron.OUTPUT):
            t, returned[key] = t[:vocab], returned[key][:vocab]
        assert returned[key].equal(t), key


def test_an_input_with_other_experts_is_refused_before_launch(tmp_path, data_dir, mixtral):
    """The Mixtral export, brought back to Megatron, starts a pretrain run of the same mixture; a dense model, or
    one with other experts, is refused naming the experts before a rank starts."""
    from conversions import megatron
    from flows.config import load
    from conftest import TINY
    from tasks.pretrain.task import PretrainInputError, build_spec
    from tasks.stage import StageContext

    megatron.from_hf(mixtral[1].output, tmp_path / "megatron")

    def spec(*overrides: str):
        cfg = load(TINY, list(overrides), stages=["data", "pretrain"])
        ctx = StageContext(stage="pretrain", run_id="t", run_dir=tmp_path, work_dir=tmp_path / "w", seed=0,
                           model=cfg.model.model_dump(), data_dir=data_dir, input=tmp_path / "megatron",
                           input_format="megatron-dist")
        return build_spec(ctx, cfg.pretrain)

    assert spec(*MOE).architecture["moe"]["num_experts"] == 4
    with pytest.raises(PretrainInputError, match=r"moe \(experts, top-k, expert ffn\) \(4, 2, 96\) \(input\) vs "
                                                 r"None \(model\)"):
        spec()
    with pytest.raises(PretrainInputError, match=r"\(4, 2, 96\) \(input\) vs \(8, 2, 96\) \(model\)"):
        spec(*MOE, "model.moe.num_experts=8")
