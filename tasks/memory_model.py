"""What a training stage declares about how its engine holds memory and disk (StageSpec.memory), read by the memory
plan (tasks/memory_plan.py) so the plan asks the stage instead of naming it. Types only: a stage package imports this
module, so it must not reach the registry (that would put every stage's code into every step's cache key)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable


class Parallelism(StrEnum):
    MEGATRON = "megatron"   # TP × PP × DP; fp32 main grads; the distributed optimizer shards the optimizer only
    ZERO = "zero"           # every rank holds the whole model; DeepSpeed ZeRO's stages shard its states


@dataclass(frozen=True)
class MemoryModel:
    engine: str                                    # its row of the CPU fit (tasks.memory_plan.CPU_FIT)
    parallelism: Parallelism
    recomputes: tuple[str, ...] = ("none",)        # the activation recompute settings its config offers
    reference_copy: bool = False                   # a frozen reference model beside the trained one (DPO)
    checkpoint_in_precision: bool = True           # False: checkpoints hold the model as trained, fp32 (the Trainer)
    config_keys: Callable[..., dict] = lambda layout: {}  # its config keys that set a chosen memory_plan.Layout
