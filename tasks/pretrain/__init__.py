from conversions.manifest import Format
from tasks.pretrain.config import PretrainConfig, host_errors, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="pretrain",
    trains=True,
    config_model=PretrainConfig,
    task="tasks.pretrain.task:run_pretrain",
    consumes=lambda cfg: Format.MEGATRON_DIST,
    produces=lambda cfg: Format.MEGATRON_DIST,
    input_required=False,
    validate=validate,
    validate_host=host_errors,
    smoke=lambda cfg: {"tensor_parallel": 1, "pipeline_parallel": 1, "sequence_parallel": False,
                       "distributed_optimizer": False, "overlap_param_gather": False, "overlap_grad_reduce": False,
                       "eval_interval": cfg.steps, "eval_iters": 1},
    batch_probe="tasks.pretrain.batch_probe:probe",
    runtime_needs=(("psutil", "which Megatron-Core needs to save checkpoints (it raises, then the other ranks hang)"),),
    description="Megatron-Core GPT pretraining (TP/PP/DP), distributed checkpoints, resume",
)
