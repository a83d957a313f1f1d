"""What a person sees from `baton run`: a calm view on a terminal and in a file, full logs in the step folders, and a
failing step's cause and log tail."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import TINY, baton, cli

pytestmark = pytest.mark.slow

NOISE = ("@@baton", "LOAD_GLOBAL", "RETURN_VALUE", "Warning", "it/s]", "Traceback")
CHAIN = ["data", "pretrain", "convert-megatron-to-hf", "rlhf", "finetune", "convert-zero-to-hf"]


def _assert_calm(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert len(lines) < 60, text
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in the default view:\n{text}"


def _assert_step_logs(run_dir: Path) -> None:
    logs = {p.parent.name: p.read_text() for p in run_dir.glob("*/step.log")}
    assert set(logs) == {f"{i:02d}-{label}" for i, label in enumerate(CHAIN + ["export", "serve"])}, sorted(logs)
    assert "[pretrain] step 20: held-out loss" in logs["01-pretrain"]
    assert "gate L2.logits_parity [ok]" in logs["02-convert-megatron-to-hf"]
    assert "Beginning flow run" in (run_dir / "run.log").read_text()  # Prefect's own lines: in the run log


@pytest.fixture(scope="module")
def tty_run(default_run):
    """The session's `baton run configs/tiny.yaml` on a pseudo-terminal (tests/default_run.py)."""
    return default_run


def test_terminal_shows_one_line_per_step_and_logs_go_to_files(tty_run):
    assert tty_run.rc == 0, tty_run.failure()
    _assert_calm(tty_run.lines)
    text = "\n".join(tty_run.lines)
    assert re.search(r"pretrain\s+completed", text) and "60/60" in text and "loss" in text, text
    assert tty_run.run_dir is not None and tty_run.run_dir.is_dir(), text
    _assert_step_logs(tty_run.run_dir)


def test_lineage_names_every_step_back_to_the_data_digest(tty_run):
    assert tty_run.rc == 0, tty_run.failure()
    run_dir, home, env, by_label = tty_run.run_dir, tty_run.home, tty_run.env, tty_run.stages
    hf = by_label["convert-zero-to-hf"]
    from flows.step_tracking import data_digest

    digest = data_digest(by_label["data"]["output"])
    for ref in (f"baton-tiny/{hf['registered']['version']}", run_dir.name, hf["output"]):
        r = cli("lineage", ref, "--json", home=home, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        nodes = json.loads(r.stdout)
        assert [n["label"] for n in nodes] == CHAIN + ["serve"], ref
        assert nodes[0]["digest"] == digest
        assert [n.get("mlflow_run_id") for n in nodes[:-1]] == [by_label[n]["mlflow_run_id"] for n in CHAIN]
        assert [n.get("prefect_flow_run_id") for n in nodes[:-1]] == [by_label[n]["prefect_flow_run_id"]
                                                                      for n in CHAIN]
        assert nodes[1]["engine"].startswith("megatron-core") and nodes[2]["gate"].startswith("passed")
    text = cli("lineage", f"baton-tiny/{hf['registered']['version']}", home=home, env=env).stdout
    assert digest[:12] in text and "↓ convert-zero-to-hf" in text
    md = (run_dir / "summary.md").read_text()
    assert "```mermaid\nflowchart LR" in md and f"digest {digest[:12]}" in md
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
    mv = c.get_model_version("baton-tiny", hf["registered"]["version"])
    assert "L2.logits_parity" in mv.description and "flowchart LR" in mv.description and digest in mv.description
    assert c.get_experiment_by_name("baton").tags["mlflow.experimentKind"] == "custom_model_development"


def test_file_output_is_plain_and_a_failure_shows_cause_and_tail(baton_home):
    r = baton("run", str(TINY), "--stages", "data,pretrain", "--set", "pretrain.steps=4",
              "--set", "pretrain.warmup_steps=1", "--set", "pretrain.checkpoint_every=4",
              "--set", "pretrain.eval_interval=4", home=baton_home, timeout=900)
    assert r.returncode == 0, r.stdout[-5000:]
    assert "\x1b" not in r.stdout and "\r" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    _assert_calm(lines)
    assert any(re.search(r"pretrain\s+running.*4/4", line) for line in lines), r.stdout
    # a config that validates but whose engine fails at run time: pretrain is killed by its own timeout (the data
    # step is reused from the run above)
    bad = baton("run", str(TINY), "--stages", "data,pretrain", "--set", "pretrain.timeout_s=4", home=baton_home,
                timeout=900)
    assert bad.returncode == 1, bad.stdout[-5000:]
    out = bad.stdout
    assert "✗ pretrain failed: pretrain timed out after 4.0s" in out, out
    log = Path(re.search(r"--- full log: (\S+)", out).group(1))
    assert log.name == "step.log" and log.parent.name == "01-pretrain"
    assert "exceeded its timeout" in log.read_text()
    tail = out.split(f"of {log} (library traceback frames left out) ---\n", 1)[1].split("--- full log:", 1)[0]
    tail = tail.splitlines()
    logged = log.read_text().splitlines()
    assert 0 < len(tail) <= 30 and tail[-1] == logged[-1] and set(tail) <= set(logged)
    assert "site-packages" not in "\n".join(tail)
    assert out.splitlines()[-1].endswith(log.parent.parent.name)


def test_a_refused_data_row_prints_its_line_and_the_log_path_not_a_traceback(baton_home, tmp_path):
    rows = [{"instruction": f"Add {i} and 1", "input": "", "output": str(i + 1)} for i in range(20)]
    del rows[7]["output"]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = baton("run", str(TINY), "--stages", "data", "--no-doctor", "--set", "data.sft.kind=files",
              "--set", f"data.sft.train={path}", "--set", "data.sft.format=alpaca", home=baton_home, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert f"✗ data failed: data.sft.train: {path}:8: field 'output': missing" in out, out
    log = Path(re.search(r"--- log: (\S+)", out).group(1))
    assert log.name == "step.log" and f"{path}:8" in log.read_text()
    assert "Traceback" not in out and 'File "' not in out and "step_runner" not in out, out
