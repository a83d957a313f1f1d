"""lm-evaluation-harness against a live OpenAI-compatible server, or on local checkpoints (the training stages' gate).

    python lm_eval_worker.py --base-url http://127.0.0.1:PORT --model NAME --key-file KEY --tasks T [--include-path D]
    python lm_eval_worker.py --checkpoint before=DIR --checkpoint after=DIR --tasks T [--include-path D] [--device cpu]

Server mode (model `local-chat-completions`): the API key is read from the 0600 key file into OPENAI_API_KEY (lm-eval's
source for it), never from the command line. Prints one `result` event: {"scores": {task: {metric: value}}, ...}.

Checkpoint mode: lm-eval's own `hf` backend on each folder, float32, greedy, the checkpoint's chat template applied.
A folder in another format (a DeepSpeed ZeRO checkpoint, per its manifest) is first converted to HF in a scratch
folder by baton's converter. Prints one `result` event: {"checkpoints": {label: {task: {metric: value}}}, ...}.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

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


def evaluate_server(args) -> dict:
    import lm_eval

    os.environ["OPENAI_API_KEY"] = args.key_file.read_text().strip()
    res = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": args.model, "base_url": f"{args.base_url}/v1/chat/completions",
                    "num_concurrent": args.num_concurrent, "max_retries": 2, "tokenized_requests": False},
        tasks=args.tasks.split(","), task_manager=task_manager(args.tasks.split(","), args.include_path),
        apply_chat_template=True, limit=args.limit, log_samples=False)
    if args.out:
        import json

        args.out.write_text(json.dumps({"results": res["results"], "n-samples": res.get("n-samples"),
                                        "versions": res.get("versions")}, indent=2, default=str))
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


def evaluate_checkpoints(args) -> dict:
    import lm_eval

    manager = task_manager(args.tasks.split(","), args.include_path)
    scores, samples = {}, {}
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for label, folder in (c.split("=", 1) for c in args.checkpoint):
            model_dir = as_hf_folder(Path(folder), Path(scratch))
            res = lm_eval.simple_evaluate(
                model="hf", model_args={"pretrained": str(model_dir), "dtype": "float32", "device": args.device,
                                        "batch_size": args.batch_size, "trust_remote_code": False},
                tasks=args.tasks.split(","), task_manager=manager, apply_chat_template=True, limit=args.limit,
                gen_kwargs=dict(GREEDY), log_samples=False, bootstrap_iters=0)
            scores[label] = numeric_scores(res["results"])
            samples[label] = res.get("n-samples")
    return {"checkpoints": scores, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", help="server mode: the server's base URL")
    ap.add_argument("--model", help="server mode: the served model name")
    ap.add_argument("--key-file", type=Path, help="server mode: the 0600 API key file")
    ap.add_argument("--checkpoint", action="append", default=[], help="checkpoint mode: LABEL=FOLDER (repeatable)")
    ap.add_argument("--device", default="cpu", help="checkpoint mode: torch device")
    ap.add_argument("--batch-size", type=int, default=8, help="checkpoint mode: documents per forward pass")
    ap.add_argument("--scratch", type=Path, help="checkpoint mode: where conversions to HF go (default: temp dir)")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--include-path", type=Path)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--num-concurrent", type=int, default=2)
    ap.add_argument("--out", type=Path, help="server mode: write lm-eval's results JSON here")
    args = ap.parse_args()
    if bool(args.checkpoint) == bool(args.base_url) or (args.base_url and not (args.model and args.key_file)):
        ap.error("give either --base-url with --model and --key-file, or --checkpoint LABEL=FOLDER")

    import lm_eval

    t0 = time.time()
    facts = evaluate_checkpoints(args) if args.checkpoint else evaluate_server(args)
    events.emit("result", **facts, seconds=round(time.time() - t0, 2), lm_eval_version=lm_eval.__version__)


if __name__ == "__main__":
    main()
