"""Serve stage: preflight the HF checkpoint, serve it with vLLM and/or SGLang (one server at a time), prove each
server right with smoke checks and lm-eval, then move the registry alias `champion` to it. With `engine: llamacpp` the
checkpoint is a GGUF export folder, served by llama-server and proven against its HF parent (tasks.serve.llamacpp).

A checkpoint that fails preflight is refused before any server starts; nothing is promoted unless every check passed.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import manifest as mf, verify
from conversions.manifest import Format
from tasks import events, tracking
from tasks.gates import LM_EVAL_WORKER
from tasks.serve import engines, llamacpp, smoke, supervisor
from tasks.serve.config import ServeConfig
from tasks.serve.routing import routing_mismatch
from tasks.serve.server import Server, ServerFailed, free_port, redactor
from tasks.stage import StageContext, StageOutput

HERE = Path(__file__).resolve().parent
SGL_PROGRAM = HERE / "sgl_program.py"
EVAL_METRIC = "lm_eval_exact_match"


def _logger():
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # outside a flow or task run (e.g. `baton serve`)
        return logging.getLogger("baton.serve")


def preflight(model_dir: Path, cfg: ServeConfig | None = None) -> list[dict]:
    """L0 integrity + the serving preflight of the format the engine serves; later checks are skipped once the files
    are known corrupt or of another format."""
    try:
        checks = verify.integrity(model_dir)
    except mf.ManifestError as e:
        return [verify.check("L0.integrity", False, str(e))]
    if not checks[-1]["passed"]:
        return checks
    want = cfg.input_format() if cfg else Format.HF_SAFETENSORS
    if (problem := format_problem(model_dir, cfg, want)) is not None:
        return checks + [problem]
    if want == Format.GGUF_FILE:
        return checks + llamacpp.preflight(model_dir)
    return checks + verify.preflight(model_dir) + verify.finite_weights(model_dir)


def format_problem(model_dir: Path, cfg: ServeConfig | None, want: str) -> dict | None:
    """A failed check when the folder is not of the format serve.engine serves (a folder without a manifest is
    taken as HF)."""
    fmt = (mf.read(model_dir) or {}).get("format") or Format.HF_SAFETENSORS
    if fmt == want:
        return None
    fix = ("export it to GGUF first (`baton export`)" if want == Format.GGUF_FILE
           else "serve it with serve.engine llamacpp")
    return verify.check("preflight.format", False, f"serve.engine {cfg.engine if cfg else 'both'} serves {want}; "
                                                   f"{model_dir} is {fmt}: {fix}")


def engine_checks(model_dir: Path, cfg: ServeConfig, runtimes: dict | None = None) -> list[dict]:
    """What the chosen engines on this device cannot run, found before a server starts and crashes."""
    if cfg.input_format() != Format.HF_SAFETENSORS:
        return []  # llama-server reads what the export's converter wrote; the models' registries are the HF engines'
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []  # L0 and the preflight report the unreadable config
    if not isinstance(config, dict):
        return []
    checks = [served_architectures_check(config, cfg, runtimes)]
    problem = engines.vllm_cpu_head_dim_problem(cfg, config)
    checks += [verify.check("preflight.vllm_cpu_head_dim", False, problem)] if problem else []
    problem = engines.vllm_cpu_quantization_problem(cfg, config)
    checks += [verify.check("preflight.vllm_cpu_quantization", False, problem)] if problem else []
    return [c for c in checks if c is not None]


def served_architectures_check(config: dict, cfg: ServeConfig, runtimes: dict | None) -> dict | None:
    """The engines' own model registries against config.json's architectures (None: a runtime is not built, which
    runtime_checks reports)."""
    from tasks.runtimes import RuntimeMissing
    from tasks.serve.architectures import RegistryUnreadable, unservable

    archs = config.get("architectures") or []
    try:
        problem = unservable(cfg.engines(), archs, runtimes)
    except RuntimeMissing:
        return None
    except RegistryUnreadable as e:
        problem = str(e)
    return verify.check("preflight.served_architectures", problem is None,
                        problem or f"{archs} in the model registry of {' and '.join(cfg.engines())}")


def runtime_checks(ctx: StageContext, cfg: ServeConfig) -> list[dict]:
    from tasks.runtimes import check_available

    needed = [engines.RUNTIME[e] for e in cfg.engines()] + (["main"] if cfg.lm_eval.enabled else [])
    problems = [p for p in (check_available(r, ctx.runtimes) for r in dict.fromkeys(needed)) if p]
    return [verify.check("preflight.runtimes", not problems, "; ".join(problems) or f"built: {', '.join(needed)}")]


def api_key(work_dir: Path, cfg: ServeConfig) -> tuple[str, Path]:
    """The server's API key and the 0600 file holding it (generated per serve unless cfg.api_key_file is set)."""
    if cfg.api_key_file:
        return cfg.api_key_file.read_text().strip(), cfg.api_key_file
    path = work_dir / "api_key"
    path.unlink(missing_ok=True)
    key = "baton-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


def model_identity(ctx: StageContext, cfg: ServeConfig, register: bool) -> dict:
    """{"name", "version", "digest"}: the registry entry of the input (found by its manifest digest tag, registered
    here when missing and `register`), and the served model name `<name>:<version>` (else the folder name)."""
    m = mf.read(ctx.input)
    name = tracking.registered_name((ctx.tracking or {}).get("registered_model") or "baton",
                                    (m or {}).get("format") or Format.HF_SAFETENSORS)
    digest = mf.digest_of(m) if m else None
    version = None
    if digest:
        c = tracking.client()
        mv = tracking.find_version_by_digest(c, name, digest)
        if mv is None and register:
            version = tracking.register_checkpoint(
                c, name, ctx.input, ctx.mlflow_run_id,
                tags={"stage": m.get("stage") or "external", "format": m["format"], "manifest_digest": digest,
                      "registered_by": "serve"}, alias=None)
        elif mv is not None:
            version = mv.version
    served = cfg.served_model_name or (f"{name}:{version}" if version else ctx.input.name)
    return {"name": name, "version": version, "digest": digest, "served_model_name": served}


def lm_eval_tasks(ctx: StageContext, cfg: ServeConfig) -> tuple[list[str], Path | None]:
    """(task names, include path): the configured tasks, else the data stage's held-out SFT task."""
    if cfg.lm_eval.tasks:
        return list(cfg.lm_eval.tasks), cfg.lm_eval.include_path
    if ctx.data_dir is None or not (ctx.data_dir / "sft" / "heldout.jsonl").exists():
        return [], None
    from tasks.data import lm_eval_task

    folder = lm_eval_task.usable_task_dir(ctx.data_dir) or lm_eval_task.write_lm_eval_task(
        ctx.data_dir, ctx.work_dir / "lm_eval_tasks")
    return [lm_eval_task.TASK_NAME], folder


def _prefixed(engine: str, checks: list[dict]) -> list[dict]:
    return [dict(c, name=f"{engine}.{c['name']}") for c in checks]


def run_lm_eval(ctx: StageContext, cfg: ServeConfig, ep: smoke.Endpoint, key_file: Path, tasks_: list[str],
                include: Path | None) -> dict:
    spec = events.LmEvalSpec(
        tasks=tasks_, include_path=include, limit=cfg.lm_eval.limit, local=None,
        server=events.LmEvalServer(base_url=ep.base_url, model=ep.model, key_file=key_file,
                                   num_concurrent=cfg.lm_eval.num_concurrent, out=ctx.work_dir / "lm_eval.json"))
    spec_path = events.write_spec(ctx.work_dir / "lm_eval_spec.json", spec)
    return ctx.launch([ctx.python("main"), str(LM_EVAL_WORKER), "--spec", str(spec_path)], name="lm-eval",
                      timeout=cfg.lm_eval.timeout_s).results()


def primary_score(scores: dict) -> float | None:
    """exact_match of the first task (any filter), the number that goes into the promotion decision."""
    for metrics in scores.values():
        for k, v in metrics.items():
            if k.split(",")[0] == "exact_match":
                return float(v)
    return None


def serve_engine(ctx: StageContext, cfg: ServeConfig, engine: str, ident: dict, key: str, key_file: Path,
                 reference: list[dict], tokenizer, serving: dict, *, evaluate: bool, keep: bool, detach: bool,
                 source: llamacpp.Source | None = None) -> dict:
    """Start one engine's server, run every smoke check against it, stop it unless keep (detach: let it outlive
    this process). `source`: what a GGUF file is proven against (its HF parent and its weights in that architecture;
    None: the served HF checkpoint itself). Returns {"checks", "metrics", "server", "eval"}."""
    log = _logger()
    port = cfg.port or free_port(cfg.host)
    base_url = f"http://{cfg.host}:{port}"
    name = engines.served_name(engine, ident["served_model_name"])
    cmd, env = engines.COMMANDS[engine](cfg, ctx.python(engines.RUNTIME[engine]), ctx.input, port, name, key,
                                        secrets_dir=ctx.work_dir)
    server = Server(engine, cmd, {**ctx.worker_env(**ctx.runtime_env(engines.RUNTIME[engine])), **env}, base_url, ctx.work_dir / f"server-{engine}.log",
                    redactor(key), on_line=lambda line: log.info("[%s] %s", engine, line), managed=not detach,
                    restarts=cfg.restarts, health_timeout=cfg.health_timeout_s)
    out: dict = {"checks": [], "metrics": {}, "server": server, "eval": None}
    server.start()
    try:
        healthy = server.wait_healthy(cfg.health_timeout_s)
    except ServerFailed as e:
        out["checks"].append(verify.check(f"{engine}.server", False, str(e).splitlines()[0] + " | " +
                                          " / ".join(e.tail[-5:])[:800]))
        server.stop()
        return out
    out["metrics"]["startup_s"] = round(healthy, 2)
    out["checks"].append(verify.check(f"{engine}.server", True, f"healthy after {healthy:.1f}s at {base_url}"))
    out["served_model_name"] = name
    ep = smoke.Endpoint(engine, base_url, key, name, chat_params={"prompt_logprobs": cfg.prompt_logprobs}
                        if engine == "vllm" and cfg.prompt_logprobs else {})
    s = cfg.smoke
    try:
        checks = smoke.endpoint_checks(ep, tokenizer, s.max_tokens) + contract_checks(
                      ep, server, tokenizer, serving)
        checks += structured_checks(ep, s, out["metrics"])
        checks.append(smoke.guarded("smoke.greedy_parity", smoke.greedy_parity, ep, reference,
                               source.hf_dir if source else ctx.input, source.model if source else None,
                               stop_token_ids(serving, tokenizer), source.tolerance if source else None))
        if engine == "sglang":
            checks.append(smoke.guarded("smoke.sgl_frontend", sgl_frontend, ctx, cfg, base_url, key_file))
        out["checks"] += _prefixed(engine, checks)
        try:
            out["metrics"].update({k: round(v, 4) for k, v in smoke.performance(ep).items() if v is not None})
        except Exception as e:
            log.warning("%s: performance probe failed: %s", engine, e)
        if evaluate:
            out["eval"] = smoke.guarded("lm_eval", run_lm_eval, ctx, cfg, ep, key_file, *lm_eval_tasks(ctx, cfg))
    finally:
        if not keep:
            server.stop()
    return out


def structured_checks(ep: smoke.Endpoint, s, metrics: dict) -> list[dict]:
    """JSON-schema and regex-constrained answers, where the engine takes them; the JSON valid rate goes to
    `metrics`."""
    checks = []
    if ep.engine in smoke.JSON_ENGINES:
        try:
            chk, rate = smoke.json_schema(ep, s.json_requests, s.max_tokens)
            metrics["json_valid_rate"] = rate
        except Exception as e:
            chk = verify.check("smoke.json_schema", False, f"{type(e).__name__}: {e}"[:500])
        checks.append(chk)
    if ep.engine in smoke.REGEX_ENGINES:
        checks.append(smoke.guarded("smoke.regex", smoke.regex, ep, 3, s.max_tokens))
    return checks


def stop_token_ids(serving: dict, tokenizer) -> list[int]:
    return serving.get("stop_token_ids") or [tokenizer.eos_token_id]


def contract_checks(ep: smoke.Endpoint, server: Server, tokenizer, serving: dict) -> list[dict]:
    """The serving contract on the live server: its chat rendering, its stop at the end of a turn, its defaults (an
    engine that takes no defaults from generation_config.json is not asked)."""
    stop_ids = stop_token_ids(serving, tokenizer)
    checks = [smoke.guarded("smoke.chat_template_parity", smoke.chat_template_parity, ep, tokenizer),
              smoke.guarded("smoke.stops_at_end_of_turn", smoke.stops_at_end_of_turn, ep, tokenizer, stop_ids)]
    if ep.engine in smoke.DEFAULT_FIELDS:
        checks.append(smoke.guarded("smoke.generation_defaults", smoke.generation_defaults, ep.engine,
                               server.log_path.read_text(errors="replace"), serving.get("generation_config")))
    return checks


def sgl_frontend(ctx: StageContext, cfg: ServeConfig, base_url: str, key_file: Path) -> dict:
    spec = events.write_spec(ctx.work_dir / "sgl_program_spec.json",
                             events.SglProgramSpec(url=base_url, key_file=key_file, n=cfg.smoke.sgl_programs))
    res = ctx.launch([ctx.python("sglang"), str(SGL_PROGRAM), "--spec", str(spec)],
                     name="sgl-frontend", timeout=600, runtime="sglang")
    return res.results()["check"]


def decide(cfg: ServeConfig, score: float | None, before: float | None, evaluated: bool) -> dict:
    """The lm-eval part of the promotion decision, as a check."""
    if not evaluated:
        return verify.check("promotion.lm_eval", True, "lm-eval not run (disabled or no task): smoke checks decide")
    if score is None:
        return verify.check("promotion.lm_eval", False, "lm-eval produced no exact_match score")
    if score < cfg.lm_eval.min_score:
        return verify.check("promotion.lm_eval", False, f"exact_match {score:.4f} < min_score {cfg.lm_eval.min_score}")
    if cfg.lm_eval.no_regression and before is not None and score < before:
        return verify.check("promotion.lm_eval", False, f"exact_match {score:.4f} < champion's {before:.4f}")
    return verify.check("promotion.lm_eval", True, f"exact_match {score:.4f} (min {cfg.lm_eval.min_score}"
                                                   + (f", champion {before:.4f}" if before is not None else "") + ")")


def champion_now(name: str) -> tuple[str | None, float | None]:
    """(version, score) of the champion this decision is made against (the promotion compares-and-sets on it);
    (None, None) only when there is none. A tracking error is raised, never read as "no champion"."""
    mv = tracking.alias_target(tracking.client(), name, tracking.CHAMPION)
    if mv is None:
        return None, None
    return str(mv.version), (float(mv.tags[EVAL_METRIC]) if EVAL_METRIC in mv.tags else None)


def _refused(ctx: StageContext, cfg: ServeConfig, pre: list[dict]) -> StageOutput:
    failed = "; ".join(f"{c['name']}: {c['detail']}" for c in pre if not c["passed"])
    _logger().error("serve: %s refused by preflight, no server started: %s", ctx.input, failed)
    return StageOutput(output=None, engine="+".join(cfg.engines()), gate=verify.report(pre),
                       extra={"served_checkpoint": str(ctx.input), "servers_started": 0, "refused": failed})


def _serve_engines(ctx: StageContext, cfg: ServeConfig, ident: dict, key: str, key_file: Path,
                   hold: bool) -> tuple[list[dict], dict, dict]:
    """Each engine in turn (stopping at the first that fails a check): (checks, metrics, results per engine)."""
    from transformers import AutoTokenizer

    from tasks.serve.reference import greedy_reference

    source = llamacpp.source(ctx.input) if cfg.input_format() == Format.GGUF_FILE else None
    hf_dir = source.hf_dir if source else ctx.input
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    reference = greedy_reference(hf_dir, cfg.smoke.parity_prompts, cfg.smoke.parity_tokens,
                                 model=source.model if source else None)
    serving = (mf.read(hf_dir) or {}).get("serving") or mf.serving_contract(hf_dir)
    checks, metrics, results, eval_done = [], {}, {}, False
    names = cfg.engines()
    for i, engine in enumerate(names):
        last = i == len(names) - 1
        t0 = time.time()
        r = serve_engine(ctx, cfg, engine, ident, key, key_file, reference, tokenizer, serving,
                         evaluate=cfg.lm_eval.enabled and not eval_done, keep=last and (cfg.keep_alive or hold),
                         detach=last and cfg.keep_alive and not hold, source=source)
        results[engine] = r
        checks += r["checks"]
        metrics.update({f"{engine}_{k}": v for k, v in r["metrics"].items()})
        metrics[f"{engine}_wall_s"] = round(time.time() - t0, 1)
        eval_done = eval_done or r["eval"] is not None
        if not all(c["passed"] for c in r["checks"]):
            break  # a broken engine already decides the gate; don't spend minutes on the next one
    rates = [v for k, v in metrics.items() if k.endswith("_json_valid_rate")]
    if rates:
        metrics["json_valid_rate"] = min(rates)
    return checks, metrics, results


def _evaluation(cfg: ServeConfig, results: dict, metrics: dict, checks: list[dict]) -> tuple[float | None, bool]:
    """lm-eval: a crash is a failed check, a score is a metric and part of the promotion decision."""
    eval_result = next((r["eval"] for r in results.values() if r["eval"] is not None), None)
    score = None
    if eval_result is not None and "passed" in eval_result:  # _guarded turned a crash into a failed check
        checks.append(dict(eval_result, name="lm_eval.run"))
    elif eval_result is not None:
        score = primary_score(eval_result.get("scores", {}))
        for task_name, ms in eval_result.get("scores", {}).items():
            metrics.update({re.sub(r"[^a-z0-9]+", "_", f"lm_eval_{task_name}_{k}".lower()).strip("_"): v
                            for k, v in ms.items()})
        metrics["lm_eval_wall_s"] = eval_result.get("seconds")
    return score, eval_result is not None


def _promote(cfg: ServeConfig, ident: dict, gate: dict, score: float | None, metrics: dict,
             decided_against: str | None) -> dict | None:
    if not (gate["passed"] and cfg.promote and ident["version"]):
        if not gate["passed"]:
            _logger().error("serve gate failed: nothing promoted")
        return None
    champion = tracking.promote_champion(
        tracking.client(), ident["name"], ident["version"],
        tags={k: v for k, v in {EVAL_METRIC: score, "served_by": "+".join(cfg.engines()),
                                "json_valid_rate": metrics.get("json_valid_rate")}.items() if v is not None},
        expected=decided_against)
    _logger().info("champion: %s version %s (previous %s)", ident["name"], ident["version"], champion["previous"])
    return champion


def _kept_server(ctx: StageContext, cfg: ServeConfig, results: dict, gate: dict, extra: dict, hold: bool):
    """The last engine's server when it stays up (keep_alive: detached with server.json; hold: in the foreground);
    a server for a checkpoint that failed its checks is never left up."""
    last = results.get(cfg.engines()[-1]) if results else None
    kept = last["server"] if last and (cfg.keep_alive or hold) else None
    if kept is None:
        return None
    if not gate["passed"]:
        kept.stop()
        return None
    if cfg.keep_alive and not hold:
        kept.write_info(ctx.work_dir / "server.json")
        extra["server"] = kept.describe()
        _logger().info("keep_alive: %s server stays up at %s (stop: %s)", kept.name, kept.base_url,
                       kept.describe()["stop"])
    return kept


def serve(ctx: StageContext, cfg: ServeConfig, hold: bool = False) -> StageOutput:
    """The whole stage. hold=True (`baton serve`): keep the last server in the foreground until Ctrl-C; the output's
    extra["engine_exit"] is the engine's exit code when it died while held."""
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    pre = preflight(ctx.input, cfg) + engine_checks(ctx.input, cfg, ctx.runtimes) + runtime_checks(ctx, cfg)
    if not all(c["passed"] for c in pre):
        return _refused(ctx, cfg, pre)
    ident = model_identity(ctx, cfg, register=cfg.promote)
    key, key_file = api_key(ctx.work_dir, cfg)
    _logger().info("serve %s as %r (API key in %s)", ctx.input, ident["served_model_name"], key_file)
    checks, metrics, results = _serve_engines(ctx, cfg, ident, key, key_file, hold)
    checks = list(pre) + checks
    decided_against, before = champion_now(ident["name"])
    score, evaluated = _evaluation(cfg, results, metrics, checks)
    checks.append(decide(cfg, score, before, evaluated and not any(c["name"] == "lm_eval.run" for c in checks)))
    gate = verify.report(checks)
    champion = _promote(cfg, ident, gate, score, metrics, decided_against)
    extra = {"served_model_name": ident["served_model_name"],
             "served_model_names": {e: r["served_model_name"] for e, r in results.items() if "served_model_name" in r},
             "served_checkpoint": str(ctx.input),
             "servers_started": sum(1 for r in results.values() if r["server"].proc is not None),
             "champion": {k: champion[k] for k in ("name", "version", "previous")} if champion else None,
             "api_key_file": str(key_file)}
    routing = {e: routing_mismatch(e, cfg.device, ctx.input) for e in results
               if cfg.input_format() == Format.HF_SAFETENSORS}  # a GGUF file's routing is not measured
    if any(routing.values()):  # a mixture of experts: per engine, the routing mismatch or why it was not measured
        extra["routing_mismatch"] = routing
    kept = _kept_server(ctx, cfg, results, gate, extra, hold)
    if kept is not None and not kept.managed and champion and champion.get("changed"):
        record_promotion(kept.state_path, ident["name"], ident["version"])
    if hold and kept is not None:
        extra["engine_exit"] = _hold(kept, extra["served_model_names"].get(kept.name, ident["served_model_name"]),
                                     key_file, cfg.restarts, cfg.health_timeout_s)
        if extra["engine_exit"]:
            _roll_back_after_death(ident, champion, extra)
    return StageOutput(output=None, engine="+".join(cfg.engines()), backend=ident["served_model_name"], gate=gate,
                       metrics={k: v for k, v in metrics.items() if v is not None},
                       eval={"metric": EVAL_METRIC, "before": before, "after": score} if evaluated else None,
                       extra=extra)


def _hold(server: Server, served: str, key_file: Path, restarts: int, health_timeout: float) -> int | None:
    """Serve in the foreground until Ctrl-C (None). An engine that dies is restarted (same command, port and key) up to
    `restarts` times; then its exit code is returned (never 0 for a crash). The same supervision runs detached
    servers (`supervisor.py`)."""
    if server.proc is None:
        return None
    print(f"\nserving {served!r} with {server.name} at {server.base_url}/v1 (API key in {key_file}; every check "
          "passed). Ctrl-C to stop.", flush=True)
    return supervisor.hold(server, restarts, health_timeout)


def record_promotion(state_path: Path, name: str, version) -> None:
    """Tell a detached server's supervisor which champion it serves, to roll back should the server keep dying."""
    from conversions import durable

    durable.write_json(Path(state_path).with_name(supervisor.PROMOTED), {"name": name, "version": str(version)})


def _roll_back_after_death(ident: dict, champion: dict | None, extra: dict) -> None:
    """The champion this serve promoted kept dying: move the alias back (only if nobody moved it since)."""
    if not champion or not champion.get("changed"):
        return
    try:
        back = tracking.rollback_champion(tracking.client(), ident["name"], expected=ident["version"])
        extra["rolled_back"] = back
        _logger().error("champion rolled back from version %s to %s: its server kept dying", back["from"], back["to"])
    except (tracking.AliasMoved, ValueError) as e:
        _logger().error("champion not rolled back: %s", e)


@task(name="serve", cache_policy=NO_CACHE)
def run_serve(ctx: StageContext, cfg: ServeConfig) -> StageOutput:
    return serve(ctx, cfg)
