from conversions.manifest import Format
from tasks.data.config import DataConfig, validate
from tasks.paths import data_source_errors
from tasks.stage import StageRole, StageSpec

STAGE = StageSpec(
    name="data",
    role=StageRole.DATA,
    config_model=DataConfig,
    task="tasks.data.task:run_data",
    consumes=lambda cfg: None,
    produces=lambda cfg: Format.DATASET,
    input_required=False,
    validate=validate,
    validate_host=lambda cfg, pipeline: data_source_errors(cfg),
    smoke=lambda cfg: {"pretrain_docs": min(cfg.pretrain_docs, 400), "preference_pairs": min(cfg.preference_pairs, 80),
                       "sft_examples": min(cfg.sft_examples, 120)},
    description="datasets in one canonical chat form (pretraining text, preference pairs, conversations) and a "
                "tokenizer (the input model's, or a new BPE with a chat template)",
)
