"""An lm-evaluation-harness task for the held-out SFT set, so any served checkpoint is scored by a tool users trust.

    write_lm_eval_task(data_dir)  ->  <data_dir>/lm_eval/baton_sft_heldout.yaml

Generation task: the last user message goes in as the user message (the server applies the chat template), the answer
(the final assistant turn, e.g. {"category": "animal"}) is the target, scored by exact match. `data_files` must be absolute: lm-eval resolves
relative paths against the current directory, not the YAML's folder.
"""
from __future__ import annotations

from pathlib import Path

import yaml

TASK_NAME = "baton_sft_heldout"
METRIC_KEY = "exact_match,strip"  # <metric>,<filter name>


def task_config(heldout_jsonl: Path, stop: str = "<|im_end|>") -> dict:
    return {
        "task": TASK_NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(Path(heldout_jsonl).resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        # canonical rows: the last user turn is the question, the final assistant turn the target
        "doc_to_text": "{{messages[-2]['content']}}",
        "doc_to_target": "{{messages[-1]['content']}}",
        "generation_kwargs": {"until": [stop], "max_gen_toks": 32, "temperature": 0, "do_sample": False},
        "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def write_lm_eval_task(data_dir: Path, out_dir: Path | None = None, stop: str = "<|im_end|>") -> Path:
    """Write the task YAML (default: <data_dir>/lm_eval/); returns the folder to pass as lm-eval's include_path."""
    data_dir = Path(data_dir)
    out_dir = Path(out_dir) if out_dir else data_dir / "lm_eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = task_config(data_dir / "sft" / "heldout.jsonl", stop=stop)
    (out_dir / f"{TASK_NAME}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out_dir


def usable_task_dir(data_dir: Path) -> Path | None:
    """The data stage's task folder, when its YAML points at this very data folder's held-out file."""
    path = Path(data_dir) / "lm_eval" / f"{TASK_NAME}.yaml"
    if not path.exists():
        return None
    files = (yaml.safe_load(path.read_text()).get("dataset_kwargs") or {}).get("data_files") or {}
    expected = (Path(data_dir) / "sft" / "heldout.jsonl").resolve()
    return path.parent if files.get("test") and Path(files["test"]).resolve() == expected else None
