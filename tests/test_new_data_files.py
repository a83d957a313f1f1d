"""Retraining sees new files, for real: `baton run --stages data --from MODEL` over a glob twice (the second run
reuses the first), then a file added under the glob re-runs data with its rows, and `baton config` plans every later
stage anew. The data stage takes the model's tokenizer, as nightly retraining from the champion does."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import baton, cli

pytestmark = pytest.mark.slow  # the data stage through the CLI and Prefect, three times (no engine)


def write_sft(path: Path, first: int, count: int) -> None:
    path.write_text("".join(json.dumps({"instruction": f"What is {i} plus {i}?", "output": f"{2 * i}"}) + "\n"
                            for i in range(first, first + count)))


def tiny_model(tmp_path: Path) -> Path:
    """A random-init HF model with its own tokenizer and a manifest (the run's --from)."""
    from conftest import make_hf_checkpoint
    from conversions import hf, manifest as mf
    from tasks.data.tokenizer import train_tokenizer

    train_tokenizer([f"What is {i} plus {i}? {2 * i}" for i in range(50)], 300, tmp_path / "tok")
    arch = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
            "ffn_hidden_size": 64, "seq_length": 128}
    dest = make_hf_checkpoint(tmp_path / "model", arch, tmp_path / "tok")
    mf.write(dest, mf.build(dest, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(dest),
                            dtype="float32"))
    return dest


def write_config(tmp_path: Path) -> Path:
    (tmp_path / "sft").mkdir()
    write_sft(tmp_path / "sft" / "part-1.jsonl", 0, 30)
    cfg = tmp_path / "files.yaml"
    cfg.write_text(f"""
name: new-files
stages: [data, rlhf, finetune]
data:
  pretrain_docs: 10
  preference_pairs: 10
  heldout_fraction: 0.2
  sft: {{kind: files, train: "{tmp_path}/sft/*.jsonl"}}
tracking: {{experiment: new-files, registered_model: new-files}}
""")
    return cfg


def data_run(cfg: Path, model: Path, home: Path) -> dict:
    r = baton("run", str(cfg), "--stages", "data", "--from", str(model), home=home, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    run = r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1]
    (stage,) = json.loads((home / "runs" / run / "summary.json").read_text())["stages"]
    return stage


def planned(cfg: Path, model: Path, home: Path) -> dict[str, tuple[str, str]]:
    """`baton config` (a dry run): label → (fingerprint prefix, 'cached' | 'to run')."""
    r = cli("config", str(cfg), "--from", str(model), home=home)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {}
    for line in r.stdout.split("# planned steps:")[1].splitlines():
        if m := re.match(r"#\s+(\S+)\s.*\s([0-9a-f]{12})\s+(cached|to run)", line):  # 'to run: <why>'
            rows[m[1]] = (m[2], m[3])
    return rows


def sft_rows(stage: dict) -> int:
    manifest = json.loads((Path(stage["output"]) / "baton_manifest.json").read_text())
    sft = manifest["extra"]["datasets"]["sft"]
    assert sft["train"]["rows"] + sft["heldout"]["rows"] == sft["rows_read"]
    return sft["rows_read"]


def test_a_file_added_under_the_glob_reruns_data_and_plans_its_successors_anew(tmp_path, baton_home):
    cfg, model = write_config(tmp_path), tiny_model(tmp_path)
    first = data_run(cfg, model, baton_home)
    assert first["status"] == "completed" and first["tokenizer"].startswith("model:") and sft_rows(first) == 30
    assert first["reason"] == [{"why": "new", "detail": []}]

    again = data_run(cfg, model, baton_home)                   # nothing changed: reused, not rebuilt
    assert again["status"] == "cached" and again["output"] == first["output"]
    assert again["reason"] == [{"why": "cached", "detail": []}]
    assert again["fingerprint"] == first["fingerprint"]
    before = planned(cfg, model, baton_home)
    assert list(before) == ["data", "rlhf", "finetune", "convert-zero-to-hf"] and before["data"] == (first["fingerprint"][:12], "cached")

    write_sft(tmp_path / "sft" / "part-2.jsonl", 30, 10)  # the nightly export adds a file
    after = planned(cfg, model, baton_home)
    assert after["data"][1] == "to run" and after["data"][0] != before["data"][0]
    for label in list(before)[1:]:                      # every successor sees new data: a new fingerprint, to run
        assert after[label][1] == "to run" and after[label][0] != before[label][0], (label, before, after)

    rerun = data_run(cfg, model, baton_home)
    assert rerun["status"] == "completed" and rerun["fingerprint"][:12] == after["data"][0]
    assert rerun["output"] != first["output"] and sft_rows(rerun) == 40
    added = str((tmp_path / "sft" / "part-2.jsonl").resolve())
    assert rerun["reason"] == [{"why": "file changed", "detail": [added]}]  # the summary says why the step re-ran
    files = json.loads((Path(rerun["output"]) / "baton_manifest.json").read_text())["extra"]["datasets"]["sft"]["files"]
    assert [Path(f).name for f in files] == ["part-1.jsonl", "part-2.jsonl"]
    assert planned(cfg, model, baton_home)["data"] == (after["data"][0], "cached")
