"""Which backend runs, and every config problem found before anything launches (cheap: no torch import)."""
from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

from tasks.gates import lm_eval_errors
from tasks.hardware import visible_gpus
from tasks.problems import ConfigProblem
from tasks.runtimes import check_available
from tasks.rlhf.nemo_rl import NORMALIZE_REWARDS, TOKEN_LEVEL_LOSS

GRPO_ONLY = ("num_generations", "max_completion_length", "rewards", "clip_epsilon", "clip_epsilon_high", "loss_type",
             "scale_rewards", "tools", "max_turns", "tool_timeout_s", "environment", "rollout_engine")
TOOL_KEYS = ("max_turns", "tool_timeout_s")  # meaningful only with rlhf.tools or rlhf.environment
ENVIRONMENT_METHODS = ("reset", "step")
DPO_ONLY = ("reference", "reference_model", "sft_weight")


def has_nvidia_gpu() -> bool:
    return visible_gpus() > 0


def nemo_rl_runtime(runtimes: dict | None) -> dict:
    spec = (runtimes or {}).get("nemo_rl") or {}
    return spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)


def resolve_backend(cfg, runtimes: dict | None) -> str:
    """auto → nemo_rl only where it can run (a GPU here, a NeMo-RL runtime configured, an algorithm it runs)."""
    if cfg.backend != "auto":
        return cfg.backend
    # grpo stays on trl: NeMo-RL scores with its math environment (math-verify), not with baton's rewards as written,
    # so running it is a choice the config states (rlhf.backend: nemo_rl)
    if cfg.algorithm != "grpo" and (runtimes or {}).get("nemo_rl") and has_nvidia_gpu():
        return "nemo_rl"
    return "trl"


def runs_here_without_a_gpu(kind: str) -> bool:
    """NeMo-RL would run on this machine (a checkout or a container here, not a Slurm job) and it has no GPU."""
    return kind in ("venv", "container") and not has_nvidia_gpu()


def nemo_rl_errors(cfg, runtime: dict, host: bool = True) -> list[ConfigProblem]:
    """What the config lacks for NeMo-RL; `host`: also the tools this machine needs to launch it."""
    kind = runtime.get("kind", "venv")
    if runs_here_without_a_gpu(kind):  # decisive: nothing else matters on this machine
        return [ConfigProblem("rlhf", "rlhf: backend nemo_rl needs an NVIDIA GPU on this machine and none was found "
                              "(no /dev/nvidia*, no GPU from nvidia-smi); NeMo-RL has no CPU path. Use "
                              "rlhf.backend=trl (or auto) here, or runtimes.nemo_rl.kind=slurm to submit to a GPU "
                              "cluster")]
    errors = nemo_rl_grpo_errors(cfg) if cfg.algorithm == "grpo" else []
    if kind == "venv":
        path = runtime.get("path")
        if not path:
            errors.append(ConfigProblem("runtimes.nemo_rl.path", "runtimes.nemo_rl.path: the NeMo-RL checkout to run "
                                        "(git clone --recursive https://github.com/NVIDIA-NeMo/RL), or set "
                                        "runtimes.nemo_rl.kind=container with an image"))
        elif not (Path(path) / "examples" / "run_dpo.py").exists():
            errors.append(ConfigProblem("runtimes.nemo_rl.path", f"runtimes.nemo_rl.path: {path} is not a NeMo-RL "
                                        "checkout (no examples/run_dpo.py)"))
    elif kind == "container":
        if not runtime.get("image"):
            errors.append(ConfigProblem("runtimes.nemo_rl.image", "runtimes.nemo_rl.image: the NeMo-RL container "
                                        "image (e.g. nvcr.io/nvidia/nemo-rl:v0.7.0)"))
    elif kind == "slurm":
        if not runtime.get("path") or not (Path(runtime["path"]) / "ray.sub").exists():
            errors.append(ConfigProblem("runtimes.nemo_rl.path", "runtimes.nemo_rl.path: a NeMo-RL checkout with "
                                        "ray.sub, on storage the cluster shares"))
        if not runtime.get("image"):
            errors.append(ConfigProblem("runtimes.nemo_rl.image", "runtimes.nemo_rl.image: the container ray.sub "
                                        "starts on each node"))
    else:
        errors.append(ConfigProblem("runtimes.nemo_rl.kind", f"runtimes.nemo_rl.kind={kind!r}: supported kinds are "
                                    "venv (a checkout), container, slurm"))
    return errors + (nemo_rl_tool_errors(kind) if host else [])


USE_TRL = "use rlhf.backend=trl"
MATH_EXTRACTS = ("last_number", "boxed")  # what NeMo-RL's math environment (math-verify) reads as the final answer


def nemo_rl_reward_errors(reward, key: str) -> list[ConfigProblem]:
    """One rlhf.rewards entry under NeMo-RL: only exact_match on the last number or \\boxed{} has an environment
    (math); a user function runs in baton's worker, which NeMo-RL never calls."""
    if reward.kind == "function":
        return [ConfigProblem(key, f"{key}: a user function runs in baton's TRL worker; NeMo-RL scores with its own "
                              f"environments and cannot call it ({USE_TRL})")]
    if reward.kind != "exact_match":
        return [ConfigProblem(key, f"{key}: kind {reward.kind} has no NeMo-RL environment (baton runs exact_match "
                              f"through its math environment; {USE_TRL})")]
    if reward.extract not in MATH_EXTRACTS:
        return [ConfigProblem(f"{key}.extract", f"{key}.extract: {reward.extract} has no NeMo-RL environment (its "
                              "math environment reads the last \\boxed{} or the last expression: extract boxed or "
                              f"last_number; {USE_TRL})")]
    return []


def nemo_rl_grpo_errors(cfg) -> list[ConfigProblem]:
    """What of a grpo config NeMo-RL's math recipe cannot run: the rewards (one exact_match), and the TRL loss and
    advantage options without a NeMo-RL counterpart."""
    if not cfg.rewards:
        return [ConfigProblem("rlhf.rewards", "rlhf.rewards: backend nemo_rl runs grpo on rlhf.rewards with "
                              "data.prompts (its math environment scores them); grpo's reward from preference pairs "
                              f"has no NeMo-RL environment ({USE_TRL})")]
    errors = nemo_rl_reward_errors(cfg.rewards[0], "rlhf.rewards[0]")
    errors += [ConfigProblem(f"rlhf.rewards[{i}]", f"rlhf.rewards[{i}]: NeMo-RL's math recipe scores each "
                             f"completion with one environment, and rlhf.rewards[0] is it ({USE_TRL} to sum rewards)")
               for i in range(1, len(cfg.rewards))]
    if cfg.loss_type not in TOKEN_LEVEL_LOSS:
        errors.append(ConfigProblem("rlhf.loss_type", f"rlhf.loss_type: {cfg.loss_type} has no NeMo-RL counterpart "
                                    f"(its loss averages per token, dapo, or per completion, grpo; {USE_TRL})"))
    if cfg.scale_rewards not in NORMALIZE_REWARDS:
        errors.append(ConfigProblem("rlhf.scale_rewards", f"rlhf.scale_rewards: {cfg.scale_rewards} has no NeMo-RL "
                                    "counterpart (it divides advantages by the group's reward std, or not: group or "
                                    f"none; {USE_TRL})"))
    return errors


NEMO_RL_TOOLS = {"venv": ("uv", "rlhf: backend nemo_rl runs NeMo-RL with `uv run`, and uv is not on PATH"),
                 "container": ("docker", "rlhf: runtimes.nemo_rl.kind=container needs docker on PATH"),
                 "slurm": ("sbatch", "rlhf: runtimes.nemo_rl.kind=slurm needs sbatch on PATH")}


def nemo_rl_tool_errors(kind: str) -> list[ConfigProblem]:
    """The program this machine runs to launch NeMo-RL (not asked when the stage runs elsewhere, e.g. `baton k8s`)."""
    tool, message = NEMO_RL_TOOLS.get(kind, (None, ""))
    return [ConfigProblem("rlhf", message)] if tool and not shutil.which(tool) else []


def sandbox_errors(cfg) -> list[ConfigProblem]:
    """code_tests with isolation required, on a machine whose kernel cannot isolate the code (probed once: a sandboxed
    child reports the layers it could not set up)."""
    keys = [f"rlhf.rewards[{i}].isolation" for i, r in enumerate(cfg.rewards)
            if r.kind == "code_tests" and r.isolation == "required"]
    if not keys:
        return []
    from tasks.rlhf import sandbox

    missing = sandbox.probe()
    return [ConfigProblem(key, f"{key}: required, and this machine cannot isolate the code: {'; '.join(missing)} "
                          "(set it to limits_only to run the tests with the resource limits alone)")
            for key in keys] if missing else []


def python_tool_errors(cfg) -> list[ConfigProblem]:
    """The python tool runs the model's code in the code_tests sandbox, isolation required: refused where this
    machine cannot isolate it."""
    if "python" not in cfg.tools:
        return []
    from tasks.rlhf import sandbox

    missing = sandbox.probe()
    return [ConfigProblem("rlhf.tools", "rlhf.tools: python runs the model's code in the sandbox, and this machine "
                          f"cannot isolate it: {'; '.join(missing)} (use the calculator only)")] if missing else []


def tools_errors(cfg, backend: str) -> list[ConfigProblem]:
    """rlhf.tools, rlhf.environment and their knobs: multi-turn episodes exist only in TRL's GRPO on rewarded
    prompts."""
    set_keys = cfg.model_fields_set
    if not cfg.tools and cfg.environment is None:
        return [ConfigProblem(f"rlhf.{k}", f"rlhf.{k}: only used with rlhf.tools or rlhf.environment (neither is set)")
                for k in TOOL_KEYS if k in set_keys and cfg.algorithm == "grpo"]
    errors = []
    if len(set(cfg.tools)) != len(cfg.tools):
        errors.append(ConfigProblem("rlhf.tools", f"rlhf.tools: a tool is listed twice ({', '.join(cfg.tools)})"))
    for key, value in (("tools", cfg.tools), ("environment", cfg.environment)):
        if not value:
            continue
        if cfg.algorithm == "grpo" and not cfg.rewards:
            errors.append(ConfigProblem(f"rlhf.{key}", f"rlhf.{key}: multi-turn episodes are GRPO on data.prompts "
                                        "scored by rlhf.rewards, and no reward is set"))
        if backend == "nemo_rl":
            errors.append(ConfigProblem(f"rlhf.{key}", f"rlhf.{key}: baton's multi-turn episodes run in its TRL "
                                        f"worker; NeMo-RL's math environment has no tools or user environment "
                                        f"({USE_TRL})"))
    if cfg.tools and cfg.max_turns < 2:
        errors.append(ConfigProblem("rlhf.max_turns", "rlhf.max_turns: with tools an episode needs at least 2 turns "
                                    "(a tool call and the answer after its result)"))
    if cfg.environment is not None:
        errors += class_source(cfg.environment, "rlhf.environment")[3]
    return errors


def rollout_engine_errors(cfg, backend: str) -> list[ConfigProblem]:
    """rlhf.rollout_engine vllm: single-turn TRL GRPO in one process (episodes with tools generate with the trainer's
    model; one engine serves one trainer)."""
    if cfg.rollout_engine == "hf" or cfg.algorithm != "grpo":
        return []
    reasons = [reason for reason, bad in (
        (f"backend {backend} samples with its own engine", backend != "trl"),
        ("episodes with rlhf.tools or rlhf.environment generate with the trainer's model", cfg.tools or cfg.environment),
        (f"one engine serves one trainer process (nproc_per_node is {cfg.nproc_per_node})", cfg.nproc_per_node > 1))
        if bad]
    return [ConfigProblem("rlhf.rollout_engine", f"rlhf.rollout_engine vllm: {r} (set rlhf.rollout_engine=hf)")
            for r in reasons]


def rollout_runtime_errors(cfg, runtimes: dict) -> list[ConfigProblem]:
    if cfg.algorithm != "grpo" or cfg.rollout_engine != "vllm":
        return []
    problem = check_available("vllm", runtimes)
    return [ConfigProblem("rlhf.rollout_engine", f"rlhf.rollout_engine vllm: {problem}")] if problem else []


def host_errors(cfg, pipeline) -> list[ConfigProblem]:
    runtimes = getattr(pipeline, "runtimes", None) or {}
    if resolve_backend(cfg, runtimes) != "nemo_rl":
        return sandbox_errors(cfg) + python_tool_errors(cfg) + rollout_runtime_errors(cfg, runtimes)
    kind = nemo_rl_runtime(runtimes).get("kind", "venv")
    if runs_here_without_a_gpu(kind):
        return []  # validate's "needs an NVIDIA GPU" is decisive: nothing else matters on this machine
    return nemo_rl_tool_errors(kind)


# ---- rlhf.rewards: every entry checked here, before launch (the worker only scores) ----------------------------------
REWARD_KEYS = {"exact_match": ("extract", "answer_field", "pattern"), "regex": ("pattern",),
               "json_schema": ("json_schema",), "length": ("min_chars", "max_chars"),
               "code_tests": ("code", "tests_field", "timeout_s", "memory_mb", "isolation"), "function": ("function",)}
COMMON_REWARD_KEYS = ("kind", "weight")


def function_source(ref: str, key: str) -> tuple[str | None, str | None, str | None,
                                                list[ConfigProblem]]:
    """(absolute path, function name, the file's text, problems) of a `path/to/rewards.py:fn` reference. The file is
    parsed, never run: the function must be defined at its top level."""
    path, name, source, tree, problems = parsed_file(ref, key, "path/to/rewards.py:function_name")
    if problems:
        return None, None, None, problems
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if name not in defined:
        return None, None, None, [ConfigProblem(key, f"{key}: {path} defines no function {name!r} at its top level "
                                                f"(it defines: {', '.join(defined) or 'none'})")]
    return path, name, source, []


def class_source(ref: str, key: str) -> tuple[str | None, str | None, str | None, list[ConfigProblem]]:
    """(absolute path, class name, the file's text, problems) of rlhf.environment's `path/to/env.py:ClassName`: a
    top-level class whose body defines reset and step (parsed, never run)."""
    path, name, source, tree, problems = parsed_file(ref, key, "path/to/env.py:ClassName")
    if problems:
        return None, None, None, problems
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        return None, None, None, [ConfigProblem(key, f"{key}: {path} defines no class {name!r} at its top level "
                                                f"(it defines: {', '.join(classes) or 'none'})")]
    methods = {n.name for n in classes[name].body if isinstance(n, ast.FunctionDef)}
    if missing := [m for m in ENVIRONMENT_METHODS if m not in methods]:
        return None, None, None, [ConfigProblem(key, f"{key}: class {name} in {path} defines no "
                                                f"{' or '.join(missing)} (an environment needs reset(prompt, **row) "
                                                "and step(reply) -> (message or None, reward, done))")]
    return path, name, source, []


def parsed_file(ref: str, key: str, form: str):
    """(absolute path, name, text, syntax tree, problems) of a `path/to/file.py:name` reference."""
    path_text, sep, name = ref.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        return None, None, None, None, [ConfigProblem(key, f"{key}: {ref!r} is not '{form}'")]
    path = Path(path_text).expanduser()
    if not path.is_file():
        return None, None, None, None, [ConfigProblem(key, f"{key}: {path}: no such file" if not path.exists() else
                                                      f"{key}: {path} is not a regular file")]
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (OSError, UnicodeDecodeError) as e:
        return None, None, None, None, [ConfigProblem(key, f"{key}: {path}: cannot read ({e})")]
    except SyntaxError as e:
        return None, None, None, None, [ConfigProblem(key, f"{key}: {path}:{e.lineno}: not valid Python ({e.msg})")]
    return str(path.resolve()), name, source, tree, []


def _pattern_errors(pattern: str | None, key: str) -> list[ConfigProblem]:
    if pattern is None:
        return [ConfigProblem(key, f"{key}: required")]
    try:
        re.compile(pattern)
    except re.error as e:
        return [ConfigProblem(key, f"{key}: {pattern!r} is not a regular expression ({e})")]
    return []


def _schema_errors(schema: dict | None, key: str) -> list[ConfigProblem]:
    if schema is None:
        return [ConfigProblem(key, f"{key}: required (the JSON Schema, inline)")]
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return [ConfigProblem(key, f"{key}: not a valid JSON Schema ({e.message})")]
    return []


def reward_errors(reward, key: str) -> list[ConfigProblem]:
    """One rlhf.rewards entry: the keys its kind reads are given and sound, no key of another kind is set."""
    own = REWARD_KEYS[reward.kind]
    errors = [f"{key}.{k}: not used by kind {reward.kind} (it reads: {', '.join(own)})"
              for k in reward.model_fields_set if k not in own + COMMON_REWARD_KEYS]
    if reward.kind == "regex" or (reward.kind == "exact_match" and reward.extract == "regex"):
        errors += _pattern_errors(reward.pattern, f"{key}.pattern")
    elif reward.kind == "exact_match" and reward.pattern is not None:
        errors.append(ConfigProblem(f"{key}.pattern", f"{key}.pattern: only used with extract regex (extract is "
                                    f"{reward.extract})"))
    if reward.kind == "json_schema":
        errors += _schema_errors(reward.json_schema, f"{key}.json_schema")
    if reward.kind == "length":
        if reward.min_chars is None and reward.max_chars is None:
            errors.append(ConfigProblem(key, f"{key}: kind length needs min_chars, max_chars or both"))
        elif None not in (reward.min_chars, reward.max_chars) and reward.min_chars > reward.max_chars:
            errors.append(ConfigProblem(key, f"{key}: min_chars {reward.min_chars} is above max_chars "
                                        f"{reward.max_chars}"))
    if reward.kind == "function" and reward.function is None:
        errors.append(ConfigProblem(f"{key}.function", f"{key}.function: required ('path/to/rewards.py:fn')"))
    elif reward.kind == "function":
        errors += function_source(reward.function, f"{key}.function")[3]
    return errors


SHOWN_BAD_ROWS = 5


def code_tests_row_errors(cfg, data_dir: Path) -> list[str]:
    """Every prompts row a code_tests reward would score carries test cases it can run (the data stage keeps a row's
    other columns as they were): 'rlhf.rewards[i].tests_field: <file>:<line>: field ...', the first few per file."""
    from tasks.rlhf import sandbox

    errors = []
    for i, r in enumerate(cfg.rewards):
        if r.kind != "code_tests":
            continue
        key = f"rlhf.rewards[{i}].tests_field"
        for split in ("train", "heldout"):
            path = data_dir / "prompts" / f"{split}.jsonl"
            lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
            bad = [(n, problem) for n, line in enumerate(lines, start=1) if line.strip()
                   if (problem := _tests_field_problem(json.loads(line), r.tests_field, sandbox))]
            errors += [f"{key}: {path}:{n}: field {r.tests_field!r}: {problem}" for n, problem in bad[:SHOWN_BAD_ROWS]]
            if len(bad) > SHOWN_BAD_ROWS:
                errors.append(f"{key}: {path}: {len(bad) - SHOWN_BAD_ROWS} more rows like these")
    return errors


def _tests_field_problem(row: dict, field: str, sandbox) -> str | None:
    if field not in row:
        return "missing (the test cases the code_tests reward runs)"
    return sandbox.tests_problem(row[field])


def rewards_errors(cfg, pipeline) -> list[ConfigProblem]:
    errors = [e for i, r in enumerate(cfg.rewards) for e in reward_errors(r, f"rlhf.rewards[{i}]")]
    data = getattr(pipeline, "data", None)
    if cfg.rewards and data is not None and "data" in pipeline.stages and data.prompts is None:
        errors.append(ConfigProblem("rlhf.rewards", "rlhf.rewards: score prompts with reference answers, and "
                                    "data.prompts is not set (e.g. data.prompts: {kind: synthetic} for the "
                                    "arithmetic task, or {kind: files, train: PATH})"))
    if cfg.gate.metric == "heldout_reward" and not cfg.rewards:
        errors.append(ConfigProblem("rlhf.gate.metric", "rlhf.gate.metric: heldout_reward needs rlhf.rewards "
                                    "(algorithm grpo on data.prompts)"))
    if cfg.gate.metric in ("heldout_loss", "preference_accuracy") and cfg.rewards:
        errors.append(ConfigProblem("rlhf.gate.metric", f"rlhf.gate.metric: {cfg.gate.metric} is measured on "
                                    "preference pairs; with rlhf.rewards the gate is heldout_reward (or lm_eval)"))
    return errors


# why an engine cannot pack an algorithm exactly (read in TRL 1.16.0 and NeMo-RL 7ea279ab)
CANNOT_PACK = {
    ("trl", "dpo"): "TRL 1.16's DPOTrainer has no packing, and its padding_free is switched off since its DPO refactor "
                    "(it warns and pads anyway)",
    ("trl", "rm"): "TRL 1.16's RewardTrainer has no packing or padding-free option",
    ("trl", "grpo"): "TRL 1.16's GRPOTrainer has no packing or padding-free option",
    ("nemo_rl", "dpo"): "NeMo-RL's DPO refuses sequence packing (it reorders the data within a batch: "
                        "NVIDIA-NeMo/RL#719)",
    ("nemo_rl", "rm"): "NeMo-RL's reward-model recipe does not pack (its policy.sequence_packing stays off)",
}


def packing_errors(cfg, backend: str) -> list[ConfigProblem]:
    reason = CANNOT_PACK.get((backend, cfg.algorithm))
    if not cfg.packing or reason is None:
        return []
    return [ConfigProblem("rlhf.packing", f"rlhf.packing: {reason}; nothing would be packed (backend {backend}, "
                          f"algorithm {cfg.algorithm}: set rlhf.packing=false)")]


def validate(cfg, pipeline) -> list[ConfigProblem]:
    errors = []
    set_keys = cfg.model_fields_set
    if cfg.gate.metric == "exact_match":
        errors.append(ConfigProblem("rlhf.gate.metric", "rlhf.gate.metric: exact_match is a finetune metric "
                                    "(heldout_loss, preference_accuracy, heldout_reward or lm_eval)"))
    if cfg.gate.metric == "lm_eval" and cfg.algorithm == "rm":
        errors.append(ConfigProblem("rlhf.gate.metric", "rlhf.gate.metric: lm_eval scores a policy, and algorithm rm "
                                    "trains a reward model (its gate is preference_accuracy)"))
    errors += lm_eval_errors(cfg.gate, "rlhf")
    errors += rewards_errors(cfg, pipeline)
    if cfg.algorithm == "dpo" and cfg.beta <= 0:
        errors.append(ConfigProblem("rlhf.beta", f"rlhf.beta: DPO needs beta > 0 (got {cfg.beta})"))
    if cfg.algorithm == "grpo" and cfg.beta < 0:
        errors.append(ConfigProblem("rlhf.beta", "rlhf.beta: the GRPO KL coefficient cannot be negative (got "
                                    f"{cfg.beta})"))
    if cfg.algorithm == "grpo" and cfg.micro_batch_size % cfg.num_generations:
        errors.append(ConfigProblem("rlhf.micro_batch_size", f"rlhf.micro_batch_size {cfg.micro_batch_size} must be "
                                    f"a multiple of rlhf.num_generations {cfg.num_generations} (GRPO compares "
                                    "completions of the same prompt)"))
    errors += [ConfigProblem(f"rlhf.{k}", f"rlhf.{k}: only used by algorithm grpo (algorithm is {cfg.algorithm})")
               for k in GRPO_ONLY if k in set_keys and cfg.algorithm != "grpo"]
    errors += [ConfigProblem(f"rlhf.{k}", f"rlhf.{k}: only used by algorithm dpo (algorithm is {cfg.algorithm})")
               for k in DPO_ONLY if k in set_keys and cfg.algorithm != "dpo"]
    if cfg.reference_model and not (Path(cfg.reference_model) / "config.json").exists():
        errors.append(ConfigProblem("rlhf.reference_model", f"rlhf.reference_model: {cfg.reference_model} is not an "
                                    "HF checkpoint folder (no config.json)"))
    seq = pipeline.model.seq_length if pipeline is not None else None
    if cfg.max_seq_length and seq and cfg.max_seq_length > seq:
        errors.append(ConfigProblem("rlhf.max_seq_length", f"rlhf.max_seq_length {cfg.max_seq_length} exceeds "
                                    f"model.seq_length {seq}"))
    runtimes = getattr(pipeline, "runtimes", None) or {}
    backend = resolve_backend(cfg, runtimes)
    errors += packing_errors(cfg, backend)
    errors += tools_errors(cfg, backend)
    errors += rollout_engine_errors(cfg, backend)
    if backend == "nemo_rl":
        errors += nemo_rl_errors(cfg, nemo_rl_runtime(runtimes), host=False)  # tools: host_errors
    return errors
