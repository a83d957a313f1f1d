"""Every stage baton knows, in the design card's order."""
from __future__ import annotations

from tasks import convert, data, finetune, pretrain, rlhf, serve
from tasks.stage import StageRole, StageSpec

STAGES: dict[str, StageSpec] = {s.name: s for s in (
    data.STAGE, pretrain.STAGE, rlhf.STAGE, finetune.STAGE, serve.STAGE, convert.STAGE)}
DEFAULT_CHAIN = ["data", "pretrain", "rlhf", "finetune", "serve"]
TRAINING_STAGES = tuple(name for name, spec in STAGES.items() if spec.trains)  # pretrain, rlhf, finetune
(DATA_STAGE,) = (name for name, spec in STAGES.items() if spec.role == StageRole.DATA)        # "data"
(CONVERT_STAGE,) = (name for name, spec in STAGES.items() if spec.role == StageRole.CONVERT)  # "convert"
