"""RLHF stage: preference optimisation of the input HF checkpoint with TRL (CPU, CI) or NeMo-RL (GPU clusters).

Both backends read the same preference pairs and write the same thing: an HF safetensors folder with the input's
tokenizer and chat template and a manifest naming the backend and algorithm. The gate: L0, serving preflight, L1
round trip, L3 generation, and held-out preference accuracy after >= before.

Reward models (algorithm rm) are not causal LMs, so they cannot continue the chain: the reward model is written beside
(`<work_dir>/reward_model`, its own manifest) and the chain's output is the input policy, passed through unchanged.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import folder, hf, manifest as mf, verify
from conversions.manifest import Format
from conversions.refusal import Refused
from tasks import chat, chat_template, events, gates, runtimes
from tasks.distributed import Launch, LaunchConfigError, engine_command, runtime_kind, stage_runtime
from tasks.rlhf import checks, nemo_rl
from tasks.rlhf.config import RlhfConfig
from tasks.stage import StageContext, StageOutput, training_engine_env

WORKER = Path(__file__).with_name("worker.py")
POLICY_LEVELS = ("L0", "preflight", "L1", "L3")


class RlhfInputError(Refused):
    pass


def dataset_of(cfg: RlhfConfig) -> str:
    """The data stage's dataset the run trains on: prompts with answers when rewards score them, else preference
    pairs."""
    return "prompts" if cfg.rewards else "preference"


def reward_specs(cfg: RlhfConfig) -> list[events.RewardSpec]:
    """rlhf.rewards as the worker reads them; a user function travels as the text of its file, read and checked here
    once (what was checked is what runs)."""
    specs = []
    for i, r in enumerate(cfg.rewards):
        function = {"path": None, "name": None, "source": None}
        if r.kind == "function":
            path, name, source, problems = checks.function_source(r.function, f"rlhf.rewards[{i}].function")
            if problems:
                raise RlhfInputError("; ".join(problems))
            function = {"path": path, "name": name, "source": source}
        specs.append(events.RewardSpec(**r.model_dump(exclude={"function"}), **function))
    return specs


def environment_spec(cfg: RlhfConfig) -> events.EnvironmentSpec | None:
    """rlhf.environment's file as the worker runs it: read and checked here once (what was checked is what runs)."""
    if cfg.environment is None:
        return None
    path, name, source, problems = checks.class_source(cfg.environment, "rlhf.environment")
    if problems:
        raise RlhfInputError("; ".join(problems))
    return events.EnvironmentSpec(path=path, name=name, source=source)


def check_inputs(ctx: StageContext, cfg: RlhfConfig) -> None:
    problems = gates.lm_eval_errors(cfg.gate, "rlhf") + gates.lm_eval_path_errors(cfg.gate, "rlhf")
    if ctx.input is None or not (Path(ctx.input) / "config.json").exists():
        problems.append(f"rlhf: input {ctx.input} is not an HF checkpoint (no config.json)")
    elif problem := chat_template.missing_problem("rlhf", ctx, "format the preference prompts"):
        problems.append(problem)
    dataset = dataset_of(cfg)
    for split in ("train", "heldout"):
        if ctx.data_dir is None or not (Path(ctx.data_dir) / dataset / f"{split}.jsonl").exists():
            hint = "set data.prompts and run the data stage" if dataset == "prompts" else "run the data stage"
            problems.append(f"rlhf: data {ctx.data_dir} lacks {dataset}/{split}.jsonl ({hint})")
    if ctx.data_dir is not None and dataset == "prompts":
        problems += checks.code_tests_row_errors(cfg, Path(ctx.data_dir))
    if not problems and dataset == "preference":  # a preference reply is trained after its prompt, as served
        rows = chat_template.first_rows(Path(ctx.data_dir) / dataset / "train.jsonl")
        sides = [r["prompt"] + r[side] for r in rows for side in ("chosen", "rejected")]
        if problem := chat_template.boundary_problem("rlhf", ctx, sides):
            problems.append(problem)
    if problems:
        raise RlhfInputError("; ".join(problems))


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def _tag_backend(ctx: StageContext, backend: str, algorithm: str) -> None:
    if not ctx.mlflow_run_id:
        return
    from tasks import tracking

    c = tracking.client()
    c.set_tag(ctx.mlflow_run_id, "baton.backend", backend)
    c.set_tag(ctx.mlflow_run_id, "baton.algorithm", algorithm)


def rollout_summary(res) -> dict:
    """GRPO's step time split: the mean rollout (generation) seconds per step, their share of the step and the
    rollouts' tokens per second (empty for algorithms that generate nothing)."""
    rollout, step = _series(res, events.ROLLOUT_TIME_S), _series(res, events.STEP_TIME_S)
    if not rollout or not step:
        return {}
    tokens_per_s, logp_diff = _series(res, events.ROLLOUT_TOKENS_PER_S), _series(res, events.ROLLOUT_LOGP_DIFF)
    out = {"rollout_time_s": sum(rollout) / len(rollout), "step_time_s": sum(step) / len(step),
           "rollout_share": sum(rollout) / sum(step), "rollout_tokens_per_s": sum(tokens_per_s) / len(tokens_per_s)}
    if logp_diff:  # rollouts from an engine (rlhf.rollout_engine): its mismatch with the trainer, per token
        out["rollout_logp_diff"] = sum(logp_diff) / len(logp_diff)
    return out


def _series(res, name: str) -> list[float]:
    return [e[name] for e in res.metrics() if isinstance(e.get(name), (int, float))]


def gate_eval(cfg: RlhfConfig, ctx: StageContext, facts: events.RlhfResult, out: Path) -> tuple[dict, dict]:
    """(summary eval entry, gate check) for the configured metric: held-out loss on the chosen replies, an lm-eval
    task on the input and the output policy `out`, or held-out preference accuracy (reward models have no loss:
    always their accuracy)."""
    metric = gates.resolve_metric(cfg.gate, ctx.data_dir, "preference", "preference_accuracy")
    if cfg.rewards and metric != "lm_eval":
        ev = {"metric": "heldout_reward", **facts.model_dump(include={
            "before", "after", "solved_before", "solved_after", "heldout_prompts"})}
        return ev, gates.check("heldout_reward", ev["before"], ev["after"], cfg.gate.min_improvement)
    if metric == "lm_eval" and cfg.algorithm != "rm":
        ev = gates.run_lm_eval(ctx, cfg.gate, out, cfg.resolved_device(), cfg.timeout_s)
        return ev, gates.lm_eval_check(ev, cfg.gate.min_improvement)
    if metric == "heldout_loss" and cfg.algorithm != "rm":
        ev = {"metric": "heldout_loss", "before": facts.heldout_loss_before, "after": facts.heldout_loss_after}
    else:
        metric = "preference_accuracy"
        ev = {"metric": facts.metric, "before": facts.before, "after": facts.after}
    return ev, gates.check(metric, ev["before"], ev["after"], cfg.gate.min_improvement, name=ev["metric"])


def reward_model_roundtrip(root: Path) -> dict:
    """L1 for a sequence-classification folder: load, save again, every tensor identical."""
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(str(root), output_loading_info=True)
    problems = [f"{k}: {sorted(map(str, info[k]))[:3]}" for k in ("missing_keys", "unexpected_keys") if info.get(k)]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        saved = hf.load_state_dict(Path(tmp))
    for name, t in hf.iter_tensors(root):
        if name not in saved or not torch.equal(t, saved[name]):
            problems.append(f"{name}: differs after save/load")
    return verify.check("L1.reward_model_roundtrip", not problems, "; ".join(problems[:5]) or
                        f"{len(saved)} reward-model tensors identical after load → save → load")


def pass_through_policy(src: Path, out: Path, reward_model: Path, stage: str, backend: str,
                        template: Path | None = None) -> None:
    """The chain's output for algorithm rm: the input policy's files, unchanged (plus the configured chat template
    when the input has none), with a manifest pointing at the RM."""
    folder.copy_tree(src, out, ignore=shutil.ignore_patterns(mf.MANIFEST_NAME, "*.trl"))
    if template is not None:
        hf.copy_tokenizer(out, out, chat_template=template)
        chat.add_end_of_turn_stop(out)
    src_m = mf.read(src) or {}
    m = mf.build(out, format=Format.HF_SAFETENSORS, stage=stage,
                 engine={"name": "baton", "note": "policy passed through"},
                 architecture=dict(src_m.get("architecture") or {}), parameter_count=hf.parameter_count(out),
                 dtype=hf.dominant_dtype(out), parent=mf.parent_ref(src),
                 extra={"backend": backend, "algorithm": "rm", "role": "policy",
                        "reward_model": {"path": str(reward_model), "digest": mf.digest_of(mf.read(reward_model))}})
    mf.write(out, m)


def _weights_unchanged(src: Path, out: Path) -> dict:
    same = all(mf.sha256_file(f) == mf.sha256_file(out / f.name) for f in hf.safetensors_files(src))
    return verify.check("policy.unchanged", same, "policy weights byte-identical to the input" if same else
                        "policy weights differ from the input")


def gate(algorithm: str, out: Path, trained: Path, src: Path, eval_check: dict) -> dict:
    """The chained policy: L0, preflight, L1, L3, finite weights, and held-out accuracy not below the input's. For rm
    the policy must be the input byte for byte, and the reward model beside it gets L0, finite weights and its own
    round trip."""
    # named here, where a diverged policy would otherwise fail only as an L1 round trip that differs (NaN != NaN)
    checks_ = verify.verify(out, levels=POLICY_LEVELS)["checks"] + verify.finite_weights(out)
    if algorithm != "rm":
        return verify.report(checks_ + [eval_check])
    rm_checks = verify.integrity(trained) + verify.finite_weights(trained) + [reward_model_roundtrip(trained)]
    return verify.report(checks_ + [_weights_unchanged(src, out)] +
                         [{**c, "name": f"reward_model.{c['name']}"} for c in rm_checks])


def worker_spec(ctx: StageContext, cfg: RlhfConfig, out: Path, template: Path | None = None,
                evaluate: bool = False) -> events.RlhfSpec:
    """What the worker reads (events.read_typed_spec): every value from the rlhf config, none defaulted in the
    worker."""
    return events.RlhfSpec(
        input=ctx.input, data=ctx.data_dir, output=out, algorithm=cfg.algorithm,
        steps=cfg.steps, micro_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.accumulation(), lr=cfg.lr, lr_schedule=cfg.lr_schedule,
        warmup_steps=cfg.warmup_steps, grad_clip=cfg.grad_clip, weight_decay=cfg.weight_decay,
        precision=cfg.precision, beta=cfg.beta, max_seq_length=cfg.max_seq_length or ctx.model.get(
            "seq_length", 128), overlong=cfg.overlong, sft_weight=cfg.sft_weight, reference=cfg.reference,
        reference_model=cfg.reference_model, num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature,
        rollout_engine=cfg.rollout_engine,
        rollout_engine_python=runtimes.python_for("vllm", ctx.runtimes) if cfg.rollout_engine == "vllm" else None,
        dataset=dataset_of(cfg), rewards=reward_specs(cfg),
        tools=list(cfg.tools), max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s,
        environment=environment_spec(cfg),
        clip_epsilon=cfg.clip_epsilon, clip_epsilon_high=cfg.clip_epsilon_high, loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards, seed=ctx.seed, dataloader_workers=cfg.dataloader_workers,
        checkpoint_every=cfg.checkpoint_every, keep_checkpoints=cfg.keep_checkpoints, stage=ctx.stage,
        chat_template=template, evaluate=evaluate)


def worker_command(ctx: StageContext, cfg: RlhfConfig, out: Path, template: Path | None = None,
                   evaluate: bool = False) -> list[str]:
    spec_name = "rlhf_eval_spec.json" if evaluate else "rlhf_spec.json"
    spec = events.write_spec(Path(ctx.work_dir) / spec_name, worker_spec(ctx, cfg, out, template, evaluate))
    args = ["--spec", str(spec)]
    if evaluate:
        return [ctx.python("main"), str(WORKER), *args]
    runtime = stage_runtime(ctx)
    if cfg.world_size() == 1 and runtime_kind(runtime) == "local":
        return [ctx.python("main"), str(WORKER), *args]
    launch = Launch(python=ctx.python("main"), script=str(WORKER), args=tuple(args), nnodes=cfg.nnodes,
                    nproc_per_node=cfg.nproc_per_node, launcher="torchrun", master_port=0)
    try:
        return engine_command(launch, runtime, Path(ctx.work_dir))
    except LaunchConfigError as e:
        raise RlhfInputError(f"rlhf: {e}") from None


def run_trl(ctx: StageContext, cfg: RlhfConfig) -> StageOutput:
    work = Path(ctx.work_dir)
    out = work / "checkpoint"
    trained = work / ("reward_model" if cfg.algorithm == "rm" else "checkpoint")
    partial = _fresh(work / f"{trained.name}.partial")
    _fresh(out)
    _fresh(trained)
    template = chat_template.for_input(ctx)
    # one intra-op thread per rank, as pretrain and finetune: on the shared 2-core machine a single rank with torch's
    # default 2 threads ran 12 DPO steps + evaluation in 16.2 s, with 1 in 5.1 s (same numbers; load 2.7)
    res = ctx.launch(worker_command(ctx, cfg, partial, template), name=f"rlhf-trl-{cfg.algorithm}",
                     timeout=cfg.timeout_s, env=training_engine_env(cfg.resolved_device()))
    # TRL's checkpoints outlive a failed attempt (the next one resumes from them), not a finished one
    shutil.rmtree(work / f"{partial.name}.trl", ignore_errors=True)
    partial.rename(trained)
    facts = res.result(events.RlhfResult)
    if cfg.algorithm == "rm":
        pass_through_policy(Path(ctx.input), out, trained, ctx.stage, backend="trl", template=template)
    margins = _series(res, "train/rewards_margins") or _series(res, "train/margin") or _series(res, "train/reward")
    metrics = facts.model_dump(include={"heldout_kl_to_reference", "train_pairs", "heldout_pairs", "overlong_dropped",
                                        "overlong_truncated", "heldout_loss_before", "heldout_loss_after",
                                        "train_prompts", "heldout_prompts"})
    metrics.update(wall_s=facts.seconds, peak_mem_mib=facts.peak_mem_mib, resumed_from_step=facts.resumed_from)
    metrics.update({f"{facts.metric}_before": facts.before, f"{facts.metric}_after": facts.after})
    if cfg.rewards:
        metrics.update(heldout_solved_before=facts.solved_before, heldout_solved_after=facts.solved_after)
    ev, eval_check = gate_eval(cfg, ctx, facts, out)
    metrics.update(gates.lm_eval_metrics(ev))
    if margins:
        metrics.update(margin_first=margins[0], margin_last=margins[-1])
    metrics.update(rollout_summary(res))
    metrics.update(episode_metrics(facts.episodes))
    return StageOutput(
        output=out, engine="trl", backend="trl", gate=gate(cfg.algorithm, out, trained, Path(ctx.input), eval_check),
        metrics=metrics, eval=ev,
        extra={"algorithm": cfg.algorithm, **({"reward_model": str(trained)} if cfg.algorithm == "rm" else {}),
               **({"episodes": facts.episodes} if facts.episodes else {})})


def episode_metrics(episodes: dict | None) -> dict:
    """rlhf.tools: the training episodes' count per end (episode_end_<end>), tool calls and model turns per episode,
    and the held-out episodes' tool calls and finished share, before and after (empty without tools)."""
    if not episodes:
        return {}
    out = {}
    train = episodes.get("train")
    if train:
        out.update({f"episode_end_{end}": count for end, count in train["ends"].items()})
        out.update(episodes_trained=train["episodes"], tool_calls=train["tool_calls"],
                   turns_per_episode=train["turns_per_episode"])
    for when in ("before", "after"):
        held = episodes[f"heldout_{when}"]
        out[f"heldout_tool_calls_{when}"] = held["tool_calls"]
        out[f"heldout_finished_{when}"] = held["ends"]["finished"] / max(held["episodes"], 1)
    return out


def write_data_files(cfg: RlhfConfig, data_dir: Path, nr_dir: Path) -> None:
    """The data stage's rows as NeMo-RL reads them: prompts with answers (grpo), else preference pairs."""
    try:
        if cfg.algorithm == "grpo":
            nemo_rl.prompt_files(data_dir, nr_dir, cfg.rewards[0].answer_field)
        else:
            nemo_rl.preference_files(data_dir, nr_dir)
    except ValueError as e:
        raise RlhfInputError(str(e)) from None


def run_nemo_rl(ctx: StageContext, cfg: RlhfConfig) -> StageOutput:
    """NeMo-RL on GPUs: our YAML over its recipe, its launcher, its consolidated HF weights + our tokenizer, a gate."""
    runtime = checks.nemo_rl_runtime(ctx.runtimes)
    errors = checks.nemo_rl_errors(cfg, runtime)
    if errors:
        raise RlhfInputError("; ".join(errors))
    from tasks import tracking

    work = Path(ctx.work_dir)
    nr_dir = work / "nemo_rl"
    write_data_files(cfg, Path(ctx.data_dir), nr_dir)
    template = chat_template.for_input(ctx)
    config = nemo_rl.build_config(
        algorithm=cfg.algorithm, runtime=runtime, input_dir=Path(ctx.input), data_dir=Path(ctx.data_dir),
        out_dir=nr_dir, cfg=cfg, seed=ctx.seed, max_length=cfg.max_seq_length or ctx.model.get("seq_length", 128),
        tracking_uri=tracking.tracking_uri(), experiment=ctx.tracking.get("experiment", "baton"),
        mlflow_run_id=ctx.mlflow_run_id, chat_template=template.read_text() if template else None)
    path = nemo_rl.write_config(nr_dir / f"nemo_rl_{cfg.algorithm}.yaml", config)
    if Path(config["defaults"]).exists():  # the recipes are on this machine: check what NeMo-RL will read first
        resolved = nemo_rl.resolve(path, nemo_rl.overrides(cfg, runtime))
        missing = nemo_rl.missing_keys(resolved, nemo_rl.KEYS_READ.get(cfg.algorithm, ()))
        if missing:
            raise RlhfInputError(f"{path}: NeMo-RL's {cfg.algorithm.upper()} reads keys the config lacks: "
                                 f"{', '.join(missing)}")
    mounts = [work, Path(ctx.input), Path(ctx.data_dir), *([Path(runtime["path"])] if runtime.get("path") else [])]
    if config["logger"]["mlflow"]["tracking_uri"].startswith("sqlite:///"):  # a file store must be visible inside too
        mounts.append(Path(config["logger"]["mlflow"]["tracking_uri"][len("sqlite:///"):]).parent)
    launch = nemo_rl.launch_command(algorithm=cfg.algorithm, cfg=cfg, runtime=runtime, config_path=path, mounts=mounts)
    ctx.launch(launch.cmd, name=f"rlhf-nemo-rl-{cfg.algorithm}", env=launch.env, timeout=cfg.timeout_s, cwd=launch.cwd)

    step = nemo_rl.latest_step(nr_dir / "results")
    if step is None:
        raise RlhfInputError(f"NeMo-RL finished but wrote no step_* checkpoint under {nr_dir / 'results'}")
    hf_src = nemo_rl.consolidated_dir(step)
    if hf_src is None:  # saved as torch DCP: NeMo-RL's own converter makes the HF folder
        hf_src = nr_dir / "hf"
        conv = nemo_rl.converter_command(cfg=cfg, runtime=runtime, step_dir=step, hf_dir=hf_src, mounts=mounts)
        ctx.launch(conv.cmd, name="rlhf-nemo-rl-convert", env=conv.env, cwd=conv.cwd, timeout=cfg.timeout_s)
    trained = work / ("reward_model" if cfg.algorithm == "rm" else "checkpoint")
    _fresh(trained)
    nemo_rl.collect_hf(hf_src, trained, Path(ctx.input), template)
    src_m = mf.read(Path(ctx.input)) or {}
    mf.write(trained, mf.build(
        trained, format=Format.HF_SAFETENSORS, stage=ctx.stage,
        engine={"name": "nemo-rl", "recipe": config["defaults"]},
        architecture=dict(src_m.get("architecture") or {}), parameter_count=hf.parameter_count(trained),
        dtype=hf.dominant_dtype(trained), parent=mf.parent_ref(Path(ctx.input)),
        extra={"backend": "nemo_rl", "algorithm": cfg.algorithm, "step_dir": str(step),
               "role": "reward-model" if cfg.algorithm == "rm" else "policy"}))
    out = work / "checkpoint"
    if cfg.algorithm == "rm":
        pass_through_policy(Path(ctx.input), out, trained, ctx.stage, backend="nemo_rl", template=template)
    # held-out accuracy of input and output, measured the same way as for TRL (the worker's evaluation only)
    res = ctx.launch(worker_command(ctx, cfg, trained, template, evaluate=True), name="rlhf-eval",
                     timeout=cfg.timeout_s)
    facts = res.result(events.RlhfResult)
    ev, eval_check = gate_eval(cfg, ctx, facts, trained)
    metrics = {"heldout_kl_to_reference": facts.heldout_kl_to_reference}
    if cfg.rewards:
        metrics.update(heldout_solved_before=facts.solved_before, heldout_solved_after=facts.solved_after)
    return StageOutput(output=out, engine="nemo-rl", backend="nemo_rl",
                       gate=gate(cfg.algorithm, out, trained, Path(ctx.input), eval_check), metrics=metrics, eval=ev,
                       extra={"algorithm": cfg.algorithm, "nemo_rl_config": str(path), "command": launch.cmd})


@task(name="rlhf", cache_policy=NO_CACHE)
def run_rlhf(ctx: StageContext, cfg: RlhfConfig) -> StageOutput:
    check_inputs(ctx, cfg)
    backend = checks.resolve_backend(cfg, ctx.runtimes)
    _tag_backend(ctx, backend, cfg.algorithm)
    return run_nemo_rl(ctx, cfg) if backend == "nemo_rl" else run_trl(ctx, cfg)
