from __future__ import annotations

import importlib.util
import os
from typing import ClassVar, Literal

from pydantic import Field

from tasks.hardware import resolve_device, visible_gpus
from tasks.problems import ConfigProblem
from tasks.vocabulary import TrainingConfig, batch_errors


class PretrainConfig(TrainingConfig):
    """Megatron-Core GPT pretraining. The architecture is the pipeline's `model:` section; data parallel size is
    derived: DP = nproc_per_node × nnodes / (TP × PP)."""

    renamed: ClassVar[dict[str, str]] = {
        "seq_length": "max_seq_length", "lr_decay_style": "lr_schedule", "clip_grad": "grad_clip",
        "save_interval": "checkpoint_every", "train_iters": "steps", "processes": "nproc_per_node"}

    tensor_parallel: int = Field(1, ge=1, description="--tensor-model-parallel-size")
    pipeline_parallel: int = Field(1, ge=1, description="--pipeline-model-parallel-size (1F1B schedule when > 1)")
    virtual_pipeline_parallel: int | None = Field(
        None, ge=1, description="--virtual-pipeline-model-parallel-size: model chunks per pipeline rank (interleaved "
                                "1F1B, a smaller bubble); needs pipeline_parallel > 1")
    expert_parallel: int = Field(
        1, ge=1, description="--expert-model-parallel-size: ranks each MoE layer's experts are split over (model.moe); "
                             "divides model.moe.num_experts; EP × expert_tensor_parallel × PP divides the ranks")
    expert_tensor_parallel: int | None = Field(
        None, ge=1, description="--expert-tensor-parallel-size: ranks each expert's matrices are split over "
                                "(model.moe; default: tensor_parallel, as Megatron's); 1 with expert_parallel > 1")
    moe_token_dispatcher: Literal["allgather", "alltoall"] = Field(
        "allgather", description="--moe-token-dispatcher-type: how tokens reach their experts' ranks (model.moe)")
    micro_batch_size: int = Field(8, ge=1, description="sequences per rank per forward/backward pass")
    global_batch_size: int | None = Field(16, ge=1, description="sequences per optimizer step, over all DP ranks")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    min_lr: float = Field(3e-4, ge=0, description="floor of the lr schedule")
    warmup_steps: int = Field(6, ge=0, description="linear warm-up steps before the schedule")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="Adam beta1")
    adam_beta2: float = Field(0.95, description="Adam beta2")
    recompute_granularity: Literal["none", "selective", "full"] = Field(
        "none", description="--recompute-granularity: activation recompute in the backward pass")
    distributed_optimizer: bool = Field(False, description="shard optimizer state over DP (ZeRO-1 style)")
    overlap_grad_reduce: bool = Field(False, description="overlap the data-parallel gradient reduce with the "
                                                         "backward pass")
    overlap_param_gather: bool = Field(False, description="needs distributed_optimizer")
    sequence_parallel: bool = Field(False, description="needs tensor_parallel > 1")
    vocab_size: int | None = Field(None, ge=1, description="embedding rows before TP padding (default: the tokenizer's)")
    make_vocab_size_divisible_by: int = Field(128, ge=1, description="rows are padded to a multiple of this × TP")
    eval_interval: int = Field(20, ge=1, description="steps between held-out evaluations")
    eval_iters: int = Field(2, ge=1, description="global batches per held-out evaluation")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="layer spec; auto: transformer_engine on GPU when installed, else local")
    attention: Literal["sdpa", "unfused"] = Field(
        "sdpa", description="the local layer spec's core attention: torch's scaled_dot_product_attention (flash or "
                            "memory-efficient kernels on GPUs) or Megatron's unfused DotProductAttention (the "
                            "seq × seq scores in memory); Transformer Engine's spec has its own")
    fp8: Literal["none", "hybrid", "e4m3"] = Field(
        "none", description="--fp8-format: FP8 GEMMs through Transformer Engine (Hopper or newer GPUs); hybrid: e4m3 "
                            "forward, e5m2 gradients")
    profile_steps: list[int] = Field(
        default_factory=list, description="training steps (1-based) to profile with torch.profiler: a table of "
                                          "every operator's CPU and GPU time per step in the stage folder")
    peak_tflops_per_rank: float | None = Field(
        None, gt=0, description="peak dense TFLOP/s of one rank for MFU (default: by device, see worker)")

    def data_parallel(self) -> int:
        return self.world_size() // (self.tensor_parallel * self.pipeline_parallel)


def resolved_device(cfg: PretrainConfig) -> str:
    return resolve_device(cfg.device)


def validate(cfg: PretrainConfig, pipeline) -> list[ConfigProblem]:
    """Errors found before anything launches (no torch import)."""
    m = pipeline.model
    tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
    e = []
    if m.num_attention_heads % tp:
        e.append(ConfigProblem("pretrain.tensor_parallel", f"pretrain.tensor_parallel {tp}: "
                               f"model.num_attention_heads {m.num_attention_heads} is not divisible by it",
                               involves=("model.num_attention_heads",)))
    if m.num_query_groups % tp:
        e.append(ConfigProblem("pretrain.tensor_parallel", f"pretrain.tensor_parallel {tp}: model.num_query_groups "
                               f"{m.num_query_groups} is not divisible by it", involves=("model.num_query_groups",)))
    if m.ffn_hidden_size % tp:
        e.append(ConfigProblem("pretrain.tensor_parallel", f"pretrain.tensor_parallel {tp}: model.ffn_hidden_size "
                               f"{m.ffn_hidden_size} is not divisible by it", involves=("model.ffn_hidden_size",)))
    if m.num_layers % pp:
        e.append(ConfigProblem("pretrain.pipeline_parallel", f"pretrain.pipeline_parallel {pp}: model.num_layers "
                               f"{m.num_layers} is not divisible by it", involves=("model.num_layers",)))
    e += virtual_pipeline_errors(cfg, m.num_layers)
    world = cfg.world_size()
    if world % (tp * pp):
        e.append(ConfigProblem("pretrain", f"pretrain: {world} ranks (nproc_per_node {cfg.nproc_per_node} × nnodes "
                               f"{cfg.nnodes}) are not a multiple of tensor_parallel × pipeline_parallel = {tp * pp}"))
    else:
        e += batch_errors(cfg, "pretrain")
    if cfg.max_seq_length is not None and cfg.max_seq_length > m.seq_length:
        e.append(ConfigProblem("pretrain.max_seq_length", f"pretrain.max_seq_length {cfg.max_seq_length} exceeds "
                               f"model.seq_length {m.seq_length} (position limit)"))
    if cfg.vocab_size is not None and cfg.vocab_size < m.vocab_size:
        e.append(ConfigProblem("pretrain.vocab_size", f"pretrain.vocab_size {cfg.vocab_size} is smaller than the "
                               f"tokenizer's vocabulary (model.vocab_size {m.vocab_size}): token ids would fall "
                               "outside the embedding"))
    if cfg.sequence_parallel and tp == 1:
        e.append(ConfigProblem("pretrain.sequence_parallel", "pretrain.sequence_parallel needs tensor_parallel > 1"))
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        e.append(ConfigProblem("pretrain.overlap_param_gather", "pretrain.overlap_param_gather needs "
                               "distributed_optimizer: true"))
    e += expert_errors(cfg, m)
    if cfg.warmup_steps >= cfg.steps:
        e.append(ConfigProblem("pretrain.warmup_steps", f"pretrain.warmup_steps {cfg.warmup_steps} must be below "
                               f"steps {cfg.steps}"))
    if cfg.min_lr > cfg.lr:
        e.append(ConfigProblem("pretrain.min_lr", f"pretrain.min_lr {cfg.min_lr} is above lr {cfg.lr}"))
    return e


def expert_tensor_parallel(cfg: PretrainConfig) -> int:
    """The experts' own tensor parallel size: the config's, else tensor_parallel (Megatron's default)."""
    return cfg.tensor_parallel if cfg.expert_tensor_parallel is None else cfg.expert_tensor_parallel


def expert_errors(cfg: PretrainConfig, model) -> list[ConfigProblem]:
    """Expert parallel: Megatron lays the experts out over the same ranks as the dense layers, but in their own
    grid: each pipeline stage's TP × DP ranks are regrouped as expert tensor parallel (ETP) × expert parallel (EP) ×
    expert data parallel, so EP × ETP × PP must divide the ranks, and EP must divide the experts."""
    ep, moe = cfg.expert_parallel, getattr(model, "moe", None)
    if moe is None:
        e = [] if ep == 1 else [ConfigProblem("pretrain.expert_parallel", f"pretrain.expert_parallel {ep} needs "
                                              "model.moe (a dense model has no experts to split)")]
        if cfg.expert_tensor_parallel not in (None, 1):
            e.append(ConfigProblem("pretrain.expert_tensor_parallel", "pretrain.expert_tensor_parallel "
                                   f"{cfg.expert_tensor_parallel} needs model.moe (a dense model has no experts)"))
        return e
    e = []
    if moe.shared_expert_ffn_hidden_size:
        e.append(ConfigProblem("model.moe.shared_expert_ffn_hidden_size", "model.moe.shared_expert_ffn_hidden_size "
                               f"{moe.shared_expert_ffn_hidden_size}: Megatron pretraining here exports to Mixtral, "
                               "which has no shared expert; set it to 0 (a shared expert runs --from an HF Qwen2-MoE "
                               "through finetune)"))
    if moe.num_experts % ep:
        e.append(ConfigProblem("pretrain.expert_parallel", f"pretrain.expert_parallel {ep}: model.moe.num_experts "
                               f"{moe.num_experts} is not divisible by it", involves=("model.moe.num_experts",)))
    world, tp, pp, etp = cfg.world_size(), cfg.tensor_parallel, cfg.pipeline_parallel, expert_tensor_parallel(cfg)
    key = "pretrain.expert_tensor_parallel" if etp > 1 else "pretrain.expert_parallel"
    if world % (tp * pp) == 0 and world % (ep * etp * pp):
        e.append(ConfigProblem(key, f"{key} {etp if etp > 1 else ep}: {world} ranks are not a multiple of "
                               f"expert_parallel {ep} × expert_tensor_parallel {etp}"
                               f"{' (tensor_parallel, the default)' if cfg.expert_tensor_parallel is None else ''} × "
                               f"pipeline_parallel {pp} = {ep * etp * pp}; the experts' grid is carved out of each "
                               "pipeline stage's ranks", involves=("pretrain.expert_parallel",)))
    elif ep > 1 and etp > 1:
        e.append(ConfigProblem("pretrain.expert_tensor_parallel", f"pretrain.expert_tensor_parallel {etp}"
                               f"{' (tensor_parallel, the default)' if cfg.expert_tensor_parallel is None else ''} "
                               f"with expert_parallel {ep}: not supported here (the Mixtral export and resume are "
                               "tested with whole experts per rank); set expert_tensor_parallel: 1",
                               involves=("pretrain.expert_parallel",)))
    if etp not in (1, tp):
        e.append(ConfigProblem("pretrain.expert_tensor_parallel", f"pretrain.expert_tensor_parallel {etp}: not "
                               f"supported here; 1 or tensor_parallel {tp}", involves=("pretrain.tensor_parallel",)))
    if tp > 1 and not cfg.sequence_parallel:
        e.append(ConfigProblem("pretrain.sequence_parallel", f"pretrain.sequence_parallel must be true with "
                               f"model.moe and tensor_parallel {tp} (Megatron's MoE layer refuses to train under "
                               "tensor parallel without it)", involves=("pretrain.tensor_parallel",)))
    if moe.expert_ffn(model) % etp:
        e.append(ConfigProblem("pretrain.expert_tensor_parallel", f"pretrain.expert_tensor_parallel {etp}: the "
                               f"experts' FFN width {moe.expert_ffn(model)} is not divisible by it",
                               involves=("model.moe.expert_ffn_hidden_size",)))
    return e


def host_errors(cfg: PretrainConfig, pipeline=None) -> list[ConfigProblem]:
    """What this machine must have to launch the ranks itself (not asked when writing manifests for a cluster)."""
    e = []
    device = resolved_device(cfg)
    if device == "cuda":
        gpus = visible_gpus()
        if cfg.nproc_per_node > gpus:
            e.append(ConfigProblem("pretrain.nproc_per_node", f"pretrain.nproc_per_node {cfg.nproc_per_node}: this "
                                   f"machine has {gpus} GPU(s); more ranks than it can host"))
    else:
        cores = os.cpu_count() or 1
        if cfg.nproc_per_node > cores:
            e.append(ConfigProblem("pretrain.nproc_per_node", f"pretrain.nproc_per_node {cfg.nproc_per_node}: this "
                                   f"machine has {cores} CPU core(s) and runs one single-threaded rank per core; "
                                   "more ranks than it can host"))
        if cfg.transformer_impl == "transformer_engine":
            e.append(ConfigProblem("pretrain.transformer_impl", "pretrain.transformer_impl transformer_engine needs "
                                   "a GPU"))
    return e + fp8_errors(cfg, device)


def virtual_pipeline_errors(cfg: PretrainConfig, num_layers: int) -> list[ConfigProblem]:
    """Interleaved 1F1B: every pipeline rank holds VP equal chunks of layers, and the micro batches of a step are
    scheduled in groups of PP (Megatron refuses a remainder group smaller than PP)."""
    vp, pp = cfg.virtual_pipeline_parallel, cfg.pipeline_parallel
    if vp is None:
        return []
    if pp < 2:
        return [ConfigProblem("pretrain.virtual_pipeline_parallel", f"pretrain.virtual_pipeline_parallel {vp} needs "
                              f"pipeline_parallel > 1 (it is {pp})")]
    e = []
    if num_layers % (pp * vp):
        e.append(ConfigProblem("pretrain.virtual_pipeline_parallel", f"pretrain.virtual_pipeline_parallel {vp}: "
                               f"model.num_layers {num_layers} is not divisible by pipeline_parallel × "
                               f"virtual_pipeline_parallel = {pp * vp}"))
    dp = cfg.data_parallel()
    if dp >= 1 and cfg.accumulation() % pp:
        e.append(ConfigProblem("pretrain.virtual_pipeline_parallel", f"pretrain.virtual_pipeline_parallel {vp}: the "
                               "interleaved schedule needs micro batches per step (global_batch_size / "
                               f"(micro_batch_size × data parallel) = {cfg.accumulation()}) to be a multiple of "
                               f"pipeline_parallel {pp}"))
    return e


def fp8_errors(cfg: PretrainConfig, device: str) -> list[ConfigProblem]:
    """FP8 runs only in Transformer Engine's kernels on a GPU: refused before launch anywhere else."""
    if cfg.fp8 == "none":
        return []
    if device != "cuda":
        return [ConfigProblem("pretrain.fp8", f"pretrain.fp8 {cfg.fp8}: FP8 needs a GPU with Transformer Engine "
                              f"(Hopper or newer); this run's device is {device}")]
    if cfg.transformer_impl == "local":
        return [ConfigProblem("pretrain.fp8", f"pretrain.fp8 {cfg.fp8}: needs transformer_impl transformer_engine or "
                              "auto (the local layer spec has no FP8 kernels)")]
    if importlib.util.find_spec("transformer_engine") is None:
        return [ConfigProblem("pretrain.fp8", f"pretrain.fp8 {cfg.fp8}: Transformer Engine (transformer_engine) is "
                              "not installed in this runtime")]
    return []
