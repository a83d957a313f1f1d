"""Where a training stage resumes: one routine for every engine's checkpoints (Megatron's `iter_NNNNNNN`, DeepSpeed's
`global_stepN`, TRL's `checkpoint-N`). Each is a folder sealed last (conversions/sealed.py). A folder without a
whole seal is a save that did not finish; a sealed folder whose bytes no longer match its seal is rejected. Resume
takes the newest sealed folder that verifies; the owner (rank 0) deletes the unfinished and the rejected, prints
each rejection and emits one `checkpoint_rejected` event for it, so every stage reports the same way.

Imported by the workers, inside the engines' runtimes: only conversions and tasks.events, no Prefect, no config."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from conversions import sealed
from conversions.manifest import Format
from tasks import events


class CheckpointKind(StrEnum):
    MEGATRON = "megatron"    # pretrain
    DEEPSPEED = "deepspeed"  # finetune
    TRL = "trl"              # rlhf

    @property
    def prefix(self) -> str:
        return _PREFIX[self]

    @property
    def marker(self) -> str:
        return _MARKER[self]

    def folder(self, root: Path, step: int) -> Path:
        return root / (f"{self.prefix}{step:07d}" if self is CheckpointKind.MEGATRON else f"{self.prefix}{step}")

    def step_of(self, folder: Path) -> int | None:
        """The step a checkpoint folder's name carries; None for a name that is not this kind's (a `.partial`)."""
        rest = folder.name[len(self.prefix):] if folder.name.startswith(self.prefix) else ""
        return int(rest) if rest.isdigit() and rest.isascii() else None


_PREFIX = {CheckpointKind.MEGATRON: "iter_", CheckpointKind.DEEPSPEED: "global_step", CheckpointKind.TRL: "checkpoint-"}
_MARKER = {CheckpointKind.MEGATRON: sealed.MARKERS[Format.MEGATRON_DIST],
           CheckpointKind.DEEPSPEED: sealed.MARKERS[Format.DEEPSPEED_ZERO],
           CheckpointKind.TRL: sealed.MARKERS[Format.DEEPSPEED_ZERO]}


@dataclass(frozen=True)
class Rejected:
    folder: Path
    reason: str


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from (None: start fresh), and what was found unusable on the way."""
    kind: CheckpointKind
    checkpoint: Path | None
    rejected: tuple[Rejected, ...] = ()
    unfinished: tuple[Path, ...] = ()

    @property
    def step(self) -> int:
        return self.kind.step_of(self.checkpoint) if self.checkpoint else 0


def checkpoints(root: Path, kind: CheckpointKind) -> list[Path]:
    """Every folder in root named as kind's checkpoints, sealed or not, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and kind.step_of(p) is not None]
    return sorted(found, key=kind.step_of)


def complete(root: Path, kind: CheckpointKind) -> list[Path]:
    """The checkpoints whose save finished (a seal, and every file it lists with its size; no byte read), oldest
    first: what keep_checkpoints counts, and what a resume verifies."""
    return [p for p in checkpoints(root, kind) if sealed.is_sealed(p, kind.marker)]


def remove_older_than_kept(root: Path, kind: CheckpointKind, keep: int) -> None:
    """Only the newest `keep` complete checkpoints stay (an unsealed one is a save in progress or a dead one)."""
    for old in complete(root, kind)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resume_point(root: Path, kind: CheckpointKind, *, owner: bool = True) -> ResumePoint:
    """The newest complete checkpoint in root whose contents verify (sha256 and the seal's HMAC), and what was not.
    The owner (rank 0) removes the unfinished and the rejected ones and reports each rejection (a log line and a
    `checkpoint_rejected` event); other ranks only read (one that finds a folder already removed rejects it too)."""
    found = checkpoints(root, kind)
    done = complete(root, kind)
    unfinished = tuple(p for p in found if p not in done)
    if owner:
        for p in unfinished:
            shutil.rmtree(p, ignore_errors=True)
    rejected = []
    while done and (why := sealed.problem(done[-1], kind.marker)) is not None:
        bad = done.pop()
        rejected.append(Rejected(bad, why))
        if owner:
            print(f"checkpoint {bad}: {why}; not resuming from it", flush=True)
            events.emit("checkpoint_rejected", tag=bad.name, reason=why)
            shutil.rmtree(bad, ignore_errors=True)
    if owner and rejected and not done:
        print(f"{root}: no checkpoint whose contents verify; starting fresh", flush=True)
    return ResumePoint(kind, done[-1] if done else None, tuple(rejected), unfinished)


def agreed_resume_point(root: Path, kind: CheckpointKind) -> Path | None:
    """resume_point as rank 0 finds it (it alone removes and reports what it rejects), broadcast to every rank of the
    default process group: all load the same checkpoint, and none reads a folder rank 0 is deleting."""
    import torch.distributed as dist  # the calling workers' engines bring torch; this module's others need none

    chosen = [resume_point(root, kind).checkpoint if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)  # picks its device from the backend (NCCL: the current CUDA device)
    return chosen[0]
