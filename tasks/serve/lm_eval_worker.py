"""lm-evaluation-harness against a live OpenAI-compatible server (model `local-chat-completions`).

    python lm_eval_worker.py --base-url http://127.0.0.1:PORT --model NAME --key-file KEY --tasks T [--include-path D]

The API key is read from the 0600 key file into OPENAI_API_KEY (lm-eval's source for it), never from the command
line. Prints one `result` event: {"scores": {task: {metric: value}}, "samples": n, "seconds": s}.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tasks import events


def task_manager(names: list[str], include_path: Path | None):
    """The include path's own tasks alone when they are all the run asks for: indexing lm-eval's ~15k built-in task
    files takes 7 s on 2 idle cores (~20 s under load). Groups, and any built-in name, get the full index."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(n in own.task_index and own.task_index[n].kind.name == "TASK" for n in names):
            return own
    return TaskManager(include_path=str(include_path) if include_path else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--key-file", type=Path, required=True)
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--include-path", type=Path)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--num-concurrent", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write lm-eval's results JSON here")
    args = ap.parse_args()
    os.environ["OPENAI_API_KEY"] = args.key_file.read_text().strip()

    import lm_eval

    t0 = time.time()
    manager = task_manager(args.tasks.split(","), args.include_path)
    res = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": args.model, "base_url": f"{args.base_url}/v1/chat/completions",
                    "num_concurrent": args.num_concurrent, "max_retries": 2, "tokenized_requests": False},
        tasks=args.tasks.split(","), task_manager=manager, apply_chat_template=True, limit=args.limit,
        log_samples=False)
    scores = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith("_stderr")
                     and "_stderr," not in k}
              for task, metrics in res["results"].items()}
    if args.out:
        import json

        args.out.write_text(json.dumps({"results": res["results"], "n-samples": res.get("n-samples"),
                                        "versions": res.get("versions")}, indent=2, default=str))
    events.emit("result", scores=scores, samples=res.get("n-samples"), seconds=round(time.time() - t0, 2),
                lm_eval_version=lm_eval.__version__)


if __name__ == "__main__":
    main()
