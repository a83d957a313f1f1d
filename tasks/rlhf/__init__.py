from conversions.manifest import Format
from tasks.rlhf.advice import advice
from tasks.rlhf.checks import host_errors, validate
from tasks.rlhf.config import RlhfConfig
from tasks.gates import lm_eval_path_errors
from tasks.memory_model import MemoryModel, Parallelism
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="rlhf",
    trains=True,
    # TRL: no recompute key yet; DPO's frozen reference copy; the Trainer saves the model as trained (fp32)
    memory=MemoryModel("trl", Parallelism.ZERO, reference_copy=True, checkpoint_in_precision=False),
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
