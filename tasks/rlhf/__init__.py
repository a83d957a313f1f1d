from conversions.manifest import Format
from tasks.rlhf.advice import advice
from tasks.rlhf.checks import host_errors, validate
from tasks.rlhf.config import RlhfConfig
from tasks.gates import lm_eval_path_errors
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="rlhf",
    trains=True,
    config_model=RlhfConfig,
    task="tasks.rlhf.task:run_rlhf",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: Format.HF_SAFETENSORS,
    validate=validate,
    validate_host=lambda cfg, pipeline: host_errors(cfg, pipeline) + lm_eval_path_errors(cfg.gate, "rlhf"),
    chat=True,
    advice=advice,
    description="preference optimisation: NeMo-RL on GPU clusters, TRL on CPU",
)
