"""The DeepSpeed JSON config, generated from the stage config (and saved beside the run, so the run is reproducible)."""
from __future__ import annotations

from tasks.finetune.config import FinetuneConfig


def zero_section(cfg: FinetuneConfig) -> dict:
    z = cfg.zero
    pin = cfg.resolved_device() == "cuda"
    out: dict = {"stage": z.stage, "overlap_comm": z.overlap_comm, "contiguous_gradients": z.contiguous_gradients,
                 "reduce_bucket_size": z.reduce_bucket_size}
    if z.stage < 3:
        out["allgather_bucket_size"] = z.allgather_bucket_size
    else:
        out["stage3_prefetch_bucket_size"] = z.prefetch_bucket_size
        out["stage3_param_persistence_threshold"] = z.param_persistence_threshold
    if z.offload_optimizer != "none":
        out["offload_optimizer"] = offload_target(z.offload_optimizer, z.nvme_path, pin)
    if z.offload_params != "none":
        out["offload_param"] = offload_target(z.offload_params, z.nvme_path, pin)
        if z.offload_params == "nvme":
            out["offload_param"].update(max_in_cpu=z.nvme_max_in_cpu, buffer_count=z.nvme_buffer_count,
                                        buffer_size=z.nvme_buffer_size)
    if z.stage == 3:  # ZeRO++ (validated: quantization on CUDA, hpZ over several nodes)
        out.update({"zero_quantized_weights": z.quantized_weights, "zero_quantized_gradients": z.quantized_gradients,
                    "zero_hpz_partition_size": z.hpz_partition_size})
    return out


def offload_target(device: str, nvme_path: str | None, pin: bool) -> dict:
    target = {"device": device, "pin_memory": pin}
    if device == "nvme":
        target["nvme_path"] = nvme_path
    return target


def uses_nvme(cfg: FinetuneConfig) -> bool:
    return "nvme" in (cfg.zero.offload_optimizer, cfg.zero.offload_params)


# DeepSpeed's async I/O settings for NVMe swapping (its documented defaults, written out so the run records them)
AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}


def scheduler_section(cfg: FinetuneConfig) -> dict:
    # DeepSpeed's warm-up divides by its length, so it is at least 1 step; `warmup_steps: 0` then starts that step at
    # the full rate (from 0 it would be one more step at lr 0: a 2-step run on a real model trained nothing)
    warmup = max(1, cfg.warmup_steps)
    start = 0.0 if cfg.warmup_steps else 1.0
    if cfg.lr_schedule == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": start * cfg.lr, "warmup_max_lr": cfg.lr,
                                               "warmup_num_steps": warmup, "warmup_type": "linear"}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": cfg.steps, "warmup_min_ratio": start,
                                                 "warmup_num_steps": warmup, "cos_min_ratio": cfg.min_lr_ratio,
                                                 "warmup_type": "linear"}}


def build(cfg: FinetuneConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.accumulation(),
        "train_batch_size": cfg.global_batch(),
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero_section(cfg),
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": cfg.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": cfg.weight_decay,
            # torch's AdamW avoids JIT-building FusedAdam/DeepSpeedCPUAdam (minutes on CPU)
            "torch_adam": cfg.optimizer == "torch_adamw"}},
        "scheduler": scheduler_section(cfg),
        **({"aio": dict(AIO)} if uses_nvme(cfg) else {}),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
