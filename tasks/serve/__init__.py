from conversions.manifest import Format
from tasks.problems import ConfigProblem
from tasks.serve.advice import advice, ports
from tasks.serve.config import ServeConfig
from tasks.serve.preflight import check_input
from tasks.serve.engines import vllm_cpu_head_dim_problem
from tasks.paths import read_errors
from tasks.stage import StageSpec


def validate(cfg: ServeConfig, pipeline) -> list[ConfigProblem]:
    """Bad serve settings fail before anything launches. (Whether the engine runtimes are built is checked when the
    stage starts, so loading a config never depends on `make runtimes`.)"""
    errors = []
    model = getattr(pipeline, "model", None)
    if model is not None:
        if model.num_query_groups % cfg.tensor_parallel:
            errors.append(ConfigProblem("serve.tensor_parallel", f"serve.tensor_parallel: {cfg.tensor_parallel} does "
                                        f"not divide model.num_query_groups {model.num_query_groups}",
                                        involves=("model.num_query_groups",)))
        if cfg.max_model_len and cfg.max_model_len > model.seq_length:
            errors.append(ConfigProblem("serve.max_model_len", f"serve.max_model_len: {cfg.max_model_len} exceeds "
                                        f"model.seq_length {model.seq_length} (the checkpoint's "
                                        "max_position_embeddings)"))
        if "pretrain" in pipeline.stages:  # the served model is the one the model section describes
            problem = vllm_cpu_head_dim_problem(cfg, {"hidden_size": model.hidden_size,
                                                      "num_attention_heads": model.num_attention_heads})
            if problem:
                errors.append(ConfigProblem("serve.engine", f"serve.engine {cfg.engine} on serve.device cpu: the "
                                            f"model section's {problem}"))
    errors += llamacpp_problems(cfg, pipeline)
    if cfg.api_key_file and not cfg.api_key_file.is_file():
        errors.append(ConfigProblem("serve.api_key_file", f"serve.api_key_file: {cfg.api_key_file}: no such file"))
    if cfg.device == "cpu" and cfg.tensor_parallel > 1:
        errors.append(ConfigProblem("serve.tensor_parallel", "serve.tensor_parallel: > 1 needs device: cuda (the CPU "
                                    "recipes serve on one process)"))
    return errors


def llamacpp_problems(cfg: ServeConfig, pipeline) -> list[ConfigProblem]:
    """llama-server serves a GGUF file on CPU: an earlier stage must write one (a run whose first model stage is serve
    takes its GGUF folder from --from)."""
    if cfg.engine != "llamacpp":
        return []
    errors = []
    if cfg.device != "cpu":
        errors.append(ConfigProblem("serve.device", "serve.device cuda: serve.engine llamacpp runs the llamacpp "
                                    "runtime's llama-server, built for CPU"))
    upstream = pipeline.formats_before("serve") - {Format.DATASET} if hasattr(pipeline, "formats_before") else set()
    if upstream and Format.GGUF_FILE not in upstream:
        writers = ", ".join(pipeline.writers(Format.GGUF_FILE)) or "none is registered"
        errors.append(ConfigProblem("serve.engine", f"serve.engine llamacpp serves a {Format.GGUF_FILE} checkpoint, "
                                    f"and no stage listed before serve writes one (they write "
                                    f"{', '.join(sorted(upstream))}); list a stage that does ({writers}) before "
                                    "serve, or serve with vllm or sglang"))
    return errors


STAGE = StageSpec(
    name="serve",
    config_model=ServeConfig,
    task="tasks.serve.task:run_serve",
    consumes=lambda cfg: cfg.input_format(),
    produces=lambda cfg: None,
    validate=validate,
    validate_host=lambda cfg, pipeline: read_errors("serve.lm_eval.include_path", cfg.lm_eval.include_path, "dir"),
    cacheable=False,
    smoke=lambda s: {"engine": s.engines()[0], "tensor_parallel": 1, "promote": False, "keep_alive": False,
                     "smoke": s.smoke.model_copy(update={"json_requests": 2, "parity_prompts": 1, "parity_tokens": 4}),
                     "lm_eval": s.lm_eval.model_copy(update={"limit": 4})},
    check_input=check_input,
    runtimes=lambda cfg: set(cfg.engines()),
    advice=advice,
    ports=ports,
    description="vLLM / SGLang OpenAI-compatible serving, smoke checks, promotion",
)
