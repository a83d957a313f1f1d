"""The few numbers workers reduce over their ranks (losses, token counts, memory peaks), on the device the process
group's backend reads: the current CUDA device under NCCL, the CPU under gloo. NCCL refuses a CPU tensor ("No backend
type associated with device type cpu"), which stopped every ZeRO run on the first GPU machine; gloo reads CPU
tensors. Workers call these instead of torch.distributed's collectives (tests/test_collectives.py holds them to it).
Worker-safe: torch only."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX


def backend_device() -> torch.device:
    """Where the default process group's backend takes its tensors."""
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce(values: Sequence, op: dist.ReduceOp = SUM) -> torch.Tensor:
    """`values` (a list, or a list of lists) reduced elementwise over every rank, in float64, back on the CPU.
    gloo has no AVG: sum, then divide."""
    t = torch.tensor(values, dtype=torch.float64, device=backend_device())
    dist.all_reduce(t, op=op)
    return t.cpu()


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    return reduce(values, SUM).tolist()


def max_over_ranks(value: float) -> float:
    return reduce([value], MAX).item()
