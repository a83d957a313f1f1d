"""Workarounds for DeepSpeed 0.19.8 (the `main` runtime's version), kept apart from the worker's recipe: they reach
into DeepSpeed's private API (stage3.py's flat buffers and swapper, engine.py's checkpoint names), so a DeepSpeed
upgrade re-checks this file first. Imported by tasks/finetune/worker.py from beside it; imports only its engine.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

DEEPSPEED_VERSION = "0.19.8"  # what the private calls below were read against


def params_off_flat_buffers(engine) -> bool:
    """ZeRO-3 with offload_param nvme: sub-groups beyond max_in_cpu have no CPU flat buffer (None), their partitions
    live in DeepSpeed's NVMe swapper. DeepSpeed 0.19.8's engine.load_checkpoint cannot load into those: stage3.py
    _rigid_load_state_dict copies into fp16_partitioned_groups_flat[i].data with no None check (AttributeError), and
    every other load path (load_module_only, load_optimizer_states=False) ends in _restore_from_bit16_weights, which
    does the same."""
    flats = getattr(engine.optimizer, "fp16_partitioned_groups_flat", None)
    return bool(flats) and any(f is None for f in flats)


# what engine._load_checkpoint keeps out of the client state it returns (DeepSpeed 0.19.8 engine.py)
DS_STATES = {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd",
             "lr_scheduler", "optimizer"}


def load_with_params_on_nvme(engine, ckpt_dir: Path, tag: str) -> dict:
    """The same state engine.load_checkpoint restores, loaded through DeepSpeed's own pieces so NVMe-resident
    sub-groups work: lr scheduler, step counters, module buffers and the client state from this rank's
    *_model_states.pt; its Adam state and fp32 master partitions from its *_optim_states.pt; then each sub-group's
    parameters rewritten from the fp32 masters by _reassign_or_swap_out_partitioned_parameters, the call every
    optimizer step ends with (a copy into the CPU flat buffer, or a write of the NVMe swap file)."""
    opt = engine.optimizer
    if opt.swap_optimizer:
        raise SystemExit("resume with offload_optimizer nvme is not supported (refused before launch)")
    folder = ckpt_dir / tag
    model_sd = engine.checkpoint_engine.load(engine._get_ckpt_name(str(ckpt_dir), tag), map_location="cpu")
    rank = dist.get_rank(group=opt.dp_process_group)
    name = engine._get_rank_zero_ckpt_name(str(ckpt_dir), tag, engine.checkpoint_mp_rank, rank,
                                           engine.bfloat16_enabled())
    zero_sd = engine.checkpoint_engine.load(name, map_location="cpu")["optimizer_state_dict"]
    opt.checkpoint_event_prologue()  # every parameter partitioned, as engine.load_checkpoint does first
    engine.load_module_state_dict(checkpoint=model_sd, strict=True)  # buffers; ZeRO-3 parameters are placeholders
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(model_sd["lr_scheduler"])
    engine.global_steps, engine.skipped_steps = model_sd["global_steps"], model_sd["skipped_steps"]
    engine.global_samples = model_sd.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.loaded_checkpoint_dp_world_size = model_sd["dp_world_size"]
    engine.loaded_checkpoint_mp_world_size = model_sd["mp_world_size"]
    opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow = (zero_sd["loss_scaler"], zero_sd["dynamic_loss_scale"],
                                                             zero_sd["overflow"])
    opt._set_fp32_optimizer_param_groups()
    opt.optimizer.load_state_dict(zero_sd["optimizer_state_dict"])
    opt._clear_fp32_optimizer_param_groups()
    saved = zero_sd["fp32_flat_groups"]
    if len(saved) != len(opt.fp32_partitioned_groups_flat):
        raise SystemExit(f"{folder}: {len(saved)} fp32 sub-groups saved, this run has "
                         f"{len(opt.fp32_partitioned_groups_flat)}")
    for i, fp32 in enumerate(saved):
        opt.fp32_partitioned_groups_flat[i].data.copy_(fp32.data)
        opt._reassign_or_swap_out_partitioned_parameters(i)
    if opt.persistent_parameters:  # as load_state_dict does: re-partition, the epilogue gathers them again
        opt.persistent_parameters[0].partition(opt.persistent_parameters)
    opt.checkpoint_event_epilogue()
    return {k: v for k, v in model_sd.items() if k not in DS_STATES}
