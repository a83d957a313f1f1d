"""Every MLflow metric name baton can log follows the one scheme of tasks/events.py (`<group>/<quantity>[_<unit>]`):
the names the workers emit, TRL's logs as the rlhf worker renames them, the stage summaries' facts, and the README's
list of them."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from tasks import events

pytestmark = pytest.mark.fast

GROUP_PREFIX = re.compile(r"^(train|eval|perf|summary)/")
# names an older baton logged: nothing may emit or read them any more
RETIRED = re.compile(r"step_time_s_last|tokens_per_s_last|peak_mem_mb|peak_gpu_allocated_mb|memory_predicted_mb"
                     r"|lm_eval_seconds|probe_peak_mb|[\"'`]summary\.(?!json|md)[a-z{]")  # the old `summary.<fact>` names


def _text(node: ast.AST) -> str | None:
    """A string literal, or an f-string with each placeholder as 'x0' (None for anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "x0" for v in node.values)
    return None


def _sample(pattern: str) -> str:
    return re.sub(r"<[^>]+>", "x0", pattern)


def _sources(*globs: str) -> list[Path]:
    return sorted(p for g in globs for p in REPO.glob(g) if ".venv" not in p.parts)


def test_the_registry_follows_its_own_scheme():
    for name in events.METRICS:
        assert events.name_problem(_sample(name)) is None, name
    for const in ("TRAIN_LOSS", "TRAIN_LR", "TRAIN_GRAD_NORM", "STEP_TIME_S", "TOKENS_PER_S", "MFU", "PEAK_MEM_MIB",
                  "HELDOUT_LOSS", "HELDOUT_PPL"):
        assert getattr(events, const) in events.METRICS, const


@pytest.mark.parametrize("bad", ["loss", "step_time", "perf/step_time", "perf/peak_mem_mb", "summary.wall_s",
                                 "summary/seconds", "perf/wall_seconds", "Train/loss", "perf/peak_mem", "system/cpu"])
def test_a_name_outside_the_scheme_is_refused_where_it_is_emitted(bad, capsys):
    assert events.name_problem(bad)
    with pytest.raises(ValueError, match="metric name"):
        events.metric(1, {bad: 1.0})
    assert capsys.readouterr().out == ""  # nothing half-written to the event stream


def test_every_name_written_in_the_code_follows_the_scheme():
    """Every grouped name spelled in the workers, tasks, flows and benchmarks, and every events.<NAME> they use."""
    found: dict[str, str] = {}
    for path in _sources("tasks/**/*.py", "flows/**/*.py", "benchmarks/*.py"):
        tree = ast.parse(path.read_text())
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # f-string pieces
        for node in ast.walk(tree):
            text = _text(node) if id(node) not in parts else None
            if text and GROUP_PREFIX.match(text) and " " not in text and not text.endswith("/"):  # prefixes: their
                found[_sample(text)] = str(path.relative_to(REPO))  # callers check what they build (checked())
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("events", "ev")
                    and node.attr.isupper() and isinstance(getattr(events, node.attr, None), str)):
                found[getattr(events, node.attr)] = str(path.relative_to(REPO))
    assert {"train/loss", "perf/step_time_s", "eval/heldout_ppl", "perf/rankx0_peak_mem_mib"} <= set(found)
    problems = [f"{where}: {events.name_problem(name)}" for name, where in found.items()
                if GROUP_PREFIX.match(name) and events.name_problem(name)]
    assert not problems, problems


def _summary_keys(path: Path) -> set[str]:
    """Keys of the dicts a stage task reports as its metrics: `metrics={...}`, `metrics = {...}`, `metrics[k] = v`,
    `metrics.update({...})`, `out["metrics"][k] = v`."""
    keys: set[str] = set()

    def dict_keys(node) -> None:
        if isinstance(node, ast.Dict):
            keys.update(k for k in map(_text, filter(None, node.keys)) if k)
        elif isinstance(node, ast.DictComp):
            keys.update(k for k in [_text(node.key)] if k)

    def is_metrics(node) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "metrics")
                or (isinstance(node, ast.Subscript) and _text(node.slice) == "metrics"))

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "metrics":
            dict_keys(node.value)
        elif isinstance(node, ast.Assign) and any(is_metrics(t) for t in node.targets):
            dict_keys(node.value)
        elif isinstance(node, ast.Assign):
            keys.update(k for t in node.targets if isinstance(t, ast.Subscript) and is_metrics(t.value)
                        for k in [_text(t.slice)] if k)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and is_metrics(node.func.value)):
            for arg in node.args:
                dict_keys(arg)
    return keys


def test_every_stage_summary_fact_is_a_valid_summary_name():
    keys = {str(p.relative_to(REPO)): _summary_keys(p) for p in _sources("tasks/*/task.py")}
    assert {"wall_s", "peak_mem_mib", "last_step_time_s"} <= keys["tasks/finetune/task.py"], keys
    assert {"train_time_s", "tokens_per_s", "mfu"} <= keys["tasks/pretrain/task.py"]
    assert {"x0_wall_s", "lm_eval_wall_s", "startup_s", "json_valid_rate"} <= keys["tasks/serve/task.py"]
    problems = [f"{path}: {key}: {e}" for path, ks in keys.items() for key in ks
                for e in [events.name_problem(f"summary/{key}")] if e]
    assert not problems, problems
    for fact in ("loss_first", "eval_heldout_ppl_before", "predicted_peak_mem_mib", "chosen_micro_batch_size"):
        assert events.summary_name(fact) == f"summary/{fact}"  # the ones flows/ adds


def _trl_log_keys() -> set[str]:
    """What the installed TRL logs from the trainers the rlhf worker runs (read from its source), plus the
    Trainer's own keys."""
    import trl

    trainers = Path(trl.__file__).parent / "trainer"
    keys = {"loss", "grad_norm", "learning_rate", "epoch", "step_time", "num_tokens"}
    for name in ("dpo_trainer.py", "reward_trainer.py", "grpo_trainer.py"):
        src = (trainers / name).read_text()
        keys |= set(re.findall(r'_metrics\[mode\]\["([^"]+)"\]', src))
        keys |= {k.replace("{reward_func_name}", "preference_reward")
                 for k in re.findall(r'_metrics\[mode\]\[f"([^"]+)"\]', src)}
    return keys


def test_trl_logs_become_scheme_names_and_none_is_dropped():
    from tasks.rlhf import worker

    keys = _trl_log_keys()
    assert {"rewards/margins", "logps/chosen", "margin", "reward", "kl", "completions/mean_length"} <= keys
    named = worker.trl_metrics({k: 1.0 for k in keys})
    assert len(named) == len(keys - worker.SKIP_LOGS)  # every log kept, under a name of its own
    assert all(events.name_problem(n) is None for n in named), named
    assert {events.TRAIN_LOSS, events.TRAIN_LR, events.TRAIN_GRAD_NORM, events.STEP_TIME_S,
            "train/rewards_margins", "train/logps_chosen"} <= set(named)
    evals = worker.eval_metrics({**{worker.metric_name(a): 1.0 for a in worker.TRAINERS}, "heldout_loss": 1.0,
                                 "heldout_kl_to_reference": 0.0})
    assert set(evals) == {"eval/heldout_pref_accuracy", "eval/heldout_reward_accuracy", events.HELDOUT_LOSS,
                          "eval/heldout_kl_to_reference"} and set(evals) <= set(events.METRICS)


def _readme_section() -> str:
    """The metric table of the docs' concepts page (moved there from the README)."""
    text = (REPO / "docs" / "concepts.md").read_text()
    return text[text.index("### Metric names"):text.index("### What you see")]


def _docs_text() -> str:
    """The README and every hand-written docs page (the generated references name no metric)."""
    pages = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.parts)]
    return "\n".join(p.read_text() for p in pages)


def test_the_readme_lists_every_name_with_its_unit():
    section = _readme_section()
    listed = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, flags=re.M))
    assert list(listed) == list(events.METRICS)
    assert all(listed[n].strip() == (u or "–") for n, (u, _) in events.METRICS.items())


def test_every_grouped_name_the_readme_mentions_is_in_the_registry():
    # re.escape leaves < and > as they are: a group's <placeholder> becomes a name's part
    patterns = [re.compile("^" + re.sub(r"<[^>]+>", "[a-z0-9_]+", re.escape(n)) + "$") for n in events.METRICS]
    mentioned = set(re.findall(r"`((?:train|eval|perf)/[a-z0-9_<>]+)`", _docs_text()))
    assert mentioned, "the docs name no metric"
    unknown = [m for m in mentioned if m not in events.METRICS and not any(p.match(m) for p in patterns)]
    assert not unknown, unknown


def test_no_tracked_file_reads_a_retired_name():
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = [f"{f}: {old}" for f in files if f != "tests/test_metric_names.py" and (REPO / f).exists()
            for old in RETIRED.findall((REPO / f).read_text(errors="replace"))]
    assert not hits, hits
