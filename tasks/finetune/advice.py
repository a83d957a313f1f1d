"""What `baton doctor` checks for the finetune stage: its DeepSpeed launch and ZeRO-3 settings, its rendezvous port."""
from __future__ import annotations

from pathlib import Path

from tasks.problems import Finding


def deepspeed_without_num_gpus(argv: list[str], device: str) -> list[Finding]:
    """The `deepspeed` launcher on a machine without GPUs starts ONE process unless --num_gpus says how many."""
    is_ds = argv and (Path(argv[0]).name == "deepspeed" or "deepspeed.launcher.runner" in argv)
    if not is_ds or device != "cpu" or any(a.startswith(("--num_gpus", "--include", "--hostfile")) for a in argv):
        return []
    return [Finding("error", "deepspeed_num_gpus", "the deepspeed launcher without --num_gpus starts a single process "
                    "on a CPU machine (it sees no GPUs), whatever the script expects",
                    "add --num_gpus N to the launch line (baton passes finetune.nproc_per_node as --num_gpus)")]


def advice(cfg) -> list[Finding]:
    found = []
    if cfg.launcher == "deepspeed":
        from tasks.distributed import Launch, local_command

        argv = local_command(Launch(python="python", script="worker.py", nnodes=1, nproc_per_node=cfg.nproc_per_node,
                                    launcher="deepspeed", master_port=29500))
        found += deepspeed_without_num_gpus(argv, cfg.resolved_device())
    if cfg.zero.stage == 3 and not cfg.zero.init:
        found.append(Finding("warning", "zero3_without_init", "ZeRO-3 without deepspeed.zero.Init() builds the whole "
                             "model on every rank before partitioning it, so large models run out of memory at load",
                             "finetune.zero.init: true"))
    return found


def ports(cfg) -> list[tuple[str, str, int]]:
    return [("finetune.master_port", "127.0.0.1", cfg.master_port)] if cfg.master_port else []
