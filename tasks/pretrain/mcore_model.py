"""The GPTModel of a Llama-family or Qwen2 decoder (Qwen2: q/k/v biases), its DDP wrapper, optimizer and LR schedule,
built from the pipeline's architecture dict and the stage config (the spec's PretrainTraining). Part of the pretrain
worker program (imported by worker.py)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from conversions.megatron import expert_ffn, has_qk_norm, has_qkv_bias, moe, moe_transformer_fields
from tasks.events import PretrainTraining
from sdpa_attention import SdpaAttention
from sequence_parallel_norm import with_sequence_parallel_norms

# Peak dense TFLOP/s of one rank, for MFU when the config does not state it. GPU numbers are the vendor's dense
# tensor-core figures (bf16; tf32 for fp32); the CPU number is nominal for one single-threaded rank
# (AVX2: 2 FMA units × 8 fp32 lanes × 2 flops × ~3 GHz ≈ 0.1 TFLOP/s).
PEAK_TFLOPS = {"H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
               "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
               "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
               "cpu": {"bf16": 0.1, "fp16": 0.1, "fp32": 0.1}}


# fp16's dynamic loss scale: it starts where PyTorch AMP's GradScaler and DeepSpeed start (2^16; Megatron's own 2^32
# costs ~30 skipped updates before the first one lands), and stops halving at the minimum, where an overflow is a
# non-finite gradient rather than a scale to lower
INITIAL_LOSS_SCALE = 2.0**16
MIN_LOSS_SCALE = 1.0


def layer_spec(impl: str, on_gpu: bool, attention: str, num_experts: int | None = None, qk_norm: bool = False):
    """Transformer Engine's spec where asked for (or `auto` on a GPU that has it), else the local spec, whose core
    attention is torch SDPA or Megatron's unfused DotProductAttention (`pretrain.attention`). With `num_experts` the
    MLP is Megatron's MoE layer (router, token dispatcher, experts: a SequentialMLP of linear layers locally); with
    `qk_norm` (Qwen3) each head's queries and keys pass an RMSNorm before RoPE."""
    if impl != "local" and on_gpu:
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
            import transformer_engine  # noqa: F401

            return (get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_norm),
                    "transformer_engine")
        except ImportError:
            if impl == "transformer_engine":
                raise
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_norm)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
        return spec, "local (sdpa attention)"
    return spec, "local"


def transformer_config(arch: dict, cfg: PretrainTraining, on_gpu: bool) -> TransformerConfig:
    bf16, fp16 = cfg.precision == "bf16", cfg.precision == "fp16"
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    recompute = cfg.recompute_granularity
    return TransformerConfig(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"],
        num_attention_heads=arch["num_attention_heads"], num_query_groups=arch["num_query_groups"],
        ffn_hidden_size=arch["ffn_hidden_size"], kv_channels=arch["hidden_size"] // arch["num_attention_heads"],
        normalization="RMSNorm", layernorm_epsilon=arch["norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=has_qkv_bias(arch),  # Qwen2: q/k/v biases, no other bias
        qk_layernorm=has_qk_norm(arch),                           # Qwen3: per-head q/k RMSNorm
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=arch["init_std"],
        tensor_model_parallel_size=cfg.tensor_parallel, pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_parallel,
        fp8=None if cfg.fp8 == "none" else cfg.fp8,  # Transformer Engine's --fp8-format
        sequence_parallel=cfg.sequence_parallel, bf16=bf16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu, perform_initialization=True,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        # fusions are CUDA kernels; Megatron falls back to plain torch with them off
        bias_activation_fusion=on_gpu, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=on_gpu, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        **moe_fields(arch, cfg),
    )


def moe_fields(arch: dict, cfg: PretrainTraining) -> dict:
    """A mixture of experts in every layer: model.moe in Megatron's names, experts split over `expert_parallel` ranks,
    tokens dispatched by all-gather or all-to-all. Routing as Mixtral's: the top-k logits, then a softmax over them
    (Megatron's default, equal to HF's softmax → top-k → renormalise)."""
    if moe(arch) is None:
        return {}
    fields = moe_transformer_fields(arch)
    return {**fields, "expert_model_parallel_size": cfg.expert_parallel,
            "expert_tensor_parallel_size": cfg.expert_tensor_parallel,
            "moe_token_dispatcher_type": cfg.moe_token_dispatcher, "moe_router_pre_softmax": False,
            "moe_router_load_balancing_type": "aux_loss" if fields.get("moe_aux_loss_coeff") else "none",
            "moe_grouped_gemm": False}


def gpt_chunks(config: TransformerConfig, spec, arch: dict, padded_vocab: int, seq_length: int) -> list[GPTModel]:
    """This rank's model chunks: one, or VP of them with the interleaved schedule (chunk i holds the layers of
    virtual stage i; only the first chunk of the first stage embeds, only the last chunk of the last stage outputs)."""
    vp = config.virtual_pipeline_model_parallel_size
    stages = [None] if vp is None else list(range(vp))
    return [GPTModel(
        config=config, transformer_layer_spec=block_spec(spec, config, i), vocab_size=padded_vocab,
        max_sequence_length=max(seq_length, arch["seq_length"]),
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=i),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=i),
        share_embeddings_and_output_weights=arch["tie_word_embeddings"], parallel_output=True,
        position_embedding_type="rope", rotary_base=int(arch["rope_theta"]), vp_stage=i,
    ) for i in stages]


def block_spec(spec, config: TransformerConfig, vp_stage: int | None):
    """The layer spec as Megatron builds it, except under sequence parallel with the local spec: its torch norms
    refuse sequence parallel, so this stage's block gets norms marked for it (sequence_parallel_norm)."""
    if not (config.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm):
        return spec
    return with_sequence_parallel_norms(copy.deepcopy(spec), get_num_layers_to_build(config, vp_stage=vp_stage))


def experts_apart(chunks: list[GPTModel]) -> None:
    """Keep the experts' parameters in their own gradient buffers and optimizer at every expert-parallel size.
    Megatron does so only under EP > 1 (it marks them `allreduce=False`; get_megatron_optimizer then chains a
    second optimizer whose state is saved under `chained_1.`); at EP 1 one optimizer would hold them, and a checkpoint
    could not resume under another EP. At EP 1 the experts' data-parallel group is the data-parallel group, so their
    gradients are reduced and scaled exactly as before."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False


def in_precision(chunks: list[GPTModel], config: TransformerConfig) -> list:
    """What Megatron-LM runs in bf16/fp16: Float16Module casts every parameter to the training dtype (norms too,
    which the local spec builds in fp32), takes inputs in that dtype on the first stage and returns fp32 logits on
    the last. Without it the mixed-precision optimizer tracks the fp32 norms outside its float16 groups and cannot
    map its state to the model's sharded parameters at save ("Param id N does not match any model sharded param").
    The chunks are cast in place; in fp32 they are returned as they are."""
    if not (config.bf16 or config.fp16):
        return chunks
    return [Float16Module(config, chunk) for chunk in chunks]


def wrap_ddp(chunks: list, config: TransformerConfig, cfg: PretrainTraining) -> list[DistributedDataParallel]:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather, use_distributed_optimizer=cfg.distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        # as Megatron-LM: only the first chunk's gradients are bucketed (the others reduce as one bucket each)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        ddp.broadcast_params()  # identical replicas across DP, whatever each rank initialised
        wrapped.append(ddp)
    return wrapped


def _per_chunk(funcs: list):
    return funcs[0] if len(funcs) == 1 else funcs


def optimizer_and_scheduler(ddps: list[DistributedDataParallel], config: TransformerConfig, cfg: PretrainTraining):
    opt_config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.grad_clip,
        bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16", params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.distributed_optimizer, overlap_param_gather=cfg.overlap_param_gather,
        initial_loss_scale=INITIAL_LOSS_SCALE, min_loss_scale=MIN_LOSS_SCALE,
    )
    optimizer = get_megatron_optimizer(opt_config, ddps)
    steps = cfg.steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=steps, lr_decay_style=cfg.lr_schedule, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
    )
    # what the schedules call: loss scaling, the grad all-reduce (and tied-embedding / layernorm grads) at the end
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if cfg.overlap_grad_reduce:
        config.no_sync_func = _per_chunk([d.no_sync for d in ddps])
        config.grad_sync_func = _per_chunk([d.start_grad_sync for d in ddps])
    if cfg.overlap_param_gather:
        config.param_sync_func = _per_chunk([d.start_param_sync for d in ddps])
    return optimizer, scheduler


def flops_per_token(arch: dict, padded_vocab: int, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward): every matmul weight a token meets twice (of a
    mixture of experts, its top-k experts and the router), plus the attention scores and values (causal masking not
    subtracted, as MFU is usually quoted)."""
    h, L = arch["hidden_size"], arch["num_layers"]
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"]
    d = h // heads
    mlp = 3 * h * arch["ffn_hidden_size"]
    if m := moe(arch):  # the experts a token goes through, and the router
        mlp = m["top_k"] * 3 * h * expert_ffn(arch) + h * m["num_experts"]
        mlp += 3 * h * (m.get("shared_expert_ffn_hidden_size") or 0)
    per_layer = h * (heads + 2 * groups) * d + heads * d * h + mlp
    matmul_params = L * per_layer + h * padded_vocab
    attention = L * 2 * 2 * seq_length * heads * d
    return 3.0 * (2.0 * matmul_params + attention)


def peak_tflops(cfg: PretrainTraining, on_gpu: bool) -> tuple[float, str]:
    if cfg.peak_tflops_per_rank:
        return float(cfg.peak_tflops_per_rank), "config"
    precision = cfg.precision
    if not on_gpu:
        return PEAK_TFLOPS["cpu"][precision], "default for one CPU rank"
    name = torch.cuda.get_device_name()
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            return table[precision], f"{key} {precision} dense"
    return PEAK_TFLOPS["H100"][precision], f"unknown GPU {name!r}: H100 {precision} dense assumed"
