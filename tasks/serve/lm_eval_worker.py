"""lm-evaluation-harness against a live OpenAI-compatible server, or on local checkpoints (the training stages' gate).

    python lm_eval_worker.py --spec SPEC.json     (an events.LmEvalSpec: `server` or `local` set)

Server mode (model `local-chat-completions`): the API key is read from the 0600 key file into OPENAI_API_KEY (lm-eval's
source for it), never from the command line. Prints one `result` event: {"scores": {task: {metric: value}}, ...}.

Checkpoint mode: lm-eval's own `hf` backend on each folder, float32, greedy, the checkpoint's chat template applied.
A folder in another format (a DeepSpeed ZeRO checkpoint, per its manifest) is first converted to HF in a scratch
folder by baton's converter. Prints one `result` event: {"checkpoints": {label: {task: {metric: value}}}, ...}.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from conversions import durable
from tasks import events

GREEDY = {"do_sample": False, "temperature": 0.0}


def numeric_scores(results: dict) -> dict:
    """{task: {"<metric>,<filter>": value}} without the standard errors."""
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith("_stderr")
                   and "_stderr," not in k}
            for task, metrics in results.items()}


def task_manager(names: list[str], include_path: Path | None):
    """The include path's own tasks alone when they are all the run asks for: indexing lm-eval's ~15k built-in task
    files takes 7 s on 2 idle cores (~20 s under load). Groups, and any built-in name, get the full index."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(n in own.task_index and own.task_index[n].kind.name == "TASK" for n in names):
            return own
    return TaskManager(include_path=str(include_path) if include_path else None)


def evaluate_server(spec: events.LmEvalSpec) -> dict:
    import lm_eval

    server = spec.server
    os.environ["OPENAI_API_KEY"] = server.key_file.read_text().strip()
    res = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": server.model, "base_url": f"{server.base_url}/v1/chat/completions",
                    "num_concurrent": server.num_concurrent, "max_retries": 2, "tokenized_requests": False},
        tasks=spec.tasks, task_manager=task_manager(spec.tasks, spec.include_path),
        apply_chat_template=True, limit=spec.limit, log_samples=False)
    durable.write_json(server.out, {"results": res["results"], "n-samples": res.get("n-samples"),
                                    "versions": res.get("versions")}, default=str)
    return {"scores": numeric_scores(res["results"]), "samples": res.get("n-samples")}


def as_hf_folder(folder: Path, scratch: Path) -> Path:
    """The folder itself when it is HF safetensors, else its conversion (by the manifest's format) under scratch."""
    from conversions import manifest as mf, registry
    from conversions.manifest import Format

    fmt = (mf.read(folder) or {}).get("format", Format.HF_SAFETENSORS)
    if fmt == Format.HF_SAFETENSORS:
        return folder
    dst = Path(tempfile.mkdtemp(prefix=f"{folder.name}-hf-", dir=scratch))
    registry.converter(fmt, Format.HF_SAFETENSORS)(folder, dst, max_shard_bytes=2 << 30)
    return dst


def evaluate_checkpoints(spec: events.LmEvalSpec) -> dict:
    import lm_eval

    local = spec.local
    manager = task_manager(spec.tasks, spec.include_path)
    scores, samples = {}, {}
    with tempfile.TemporaryDirectory(dir=local.scratch) as scratch:
        for label, folder in local.checkpoints.items():
            model_dir = as_hf_folder(folder, Path(scratch))
            res = lm_eval.simple_evaluate(
                model="hf", model_args={"pretrained": str(model_dir), "dtype": "float32", "device": local.device,
                                        "batch_size": local.batch_size, "trust_remote_code": False},
                tasks=spec.tasks, task_manager=manager, apply_chat_template=True, limit=spec.limit,
                gen_kwargs=dict(GREEDY), log_samples=False, bootstrap_iters=0)
            scores[label] = numeric_scores(res["results"])
            samples[label] = res.get("n-samples")
    return {"checkpoints": scores, "samples": samples}


def main() -> None:
    spec = events.read_typed_spec(events.LmEvalSpec)
    import lm_eval

    t0 = time.time()
    facts = evaluate_checkpoints(spec) if spec.local else evaluate_server(spec)
    events.emit("result", **facts, seconds=round(time.time() - t0, 2), lm_eval_version=lm_eval.__version__)


if __name__ == "__main__":
    main()
