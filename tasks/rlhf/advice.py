"""What `baton doctor` checks for the rlhf stage."""
from __future__ import annotations

from tasks.problems import Finding

MAX_DATALOADER_WORKERS = 8


def advice(cfg) -> list[Finding]:
    if cfg.dataloader_workers <= MAX_DATALOADER_WORKERS:
        return []
    return [Finding("warning", "dataloader_workers", f"rlhf.dataloader_workers {cfg.dataloader_workers}: each worker "
                    f"process copies the dataset and the parent's memory; above {MAX_DATALOADER_WORKERS} CPU RAM "
                    "blows up", "rlhf.dataloader_workers: 4")]
