"""The export stage in the relay (tasks/export/: `export:` in a run config, after finetune): each type of
`export.types` written from the HF checkpoint the relay hands it, gated, published with its `gguf-file` manifest and
registered as its own model version (alias: the type), visible in `baton lineage`. The session's default run
(configs/tiny.yaml lists the stage) is checked with `check_exports` in test_default_run.py; here, a gate that says no
for one type: the stage fails with one line and nothing is registered, not even the type that passed."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY, baton, mlflow_client

GGUF_MODEL = "baton-tiny-gguf-file"  # tracking.registered_model, then the format: step_runner._register


def check_exports(stage: dict, hf_output: str, client, lineage: list[dict]) -> None:
    """A completed export step: one published, registered GGUF folder per type, its gate's numbers in the step's
    MLflow run beside its manifest, and `lineage` (of `baton-tiny-gguf-file@q8_0`) ending in the export."""
    from conversions import gguf_export, manifest as mf

    assert stage["output"] is None and set(stage["side_outputs"]) == {"f16", "q8_0"}, stage
    logged = client.get_run(stage["mlflow_run_id"]).data.metrics
    for kind, side in stage["side_outputs"].items():
        m = mf.read(Path(side["output"]))
        assert m["format"] == mf.Format.GGUF_FILE and m["extra"]["gguf_type"] == kind
        assert m["parent"]["digest"] == mf.digest_of(mf.read(Path(hf_output)))
        assert stage["metrics"][f"{kind}_logit_rms"] <= gguf_export.TYPES[kind].max_logit_rms
        for fact in ("logit_rms", "argmax_agreement", "size_bytes", "convert_s", "gate_s"):
            assert logged[f"summary/{kind}_{fact}"] == stage["metrics"][f"{kind}_{fact}"], (kind, fact)
        assert [a.path for a in client.list_artifacts(stage["mlflow_run_id"], kind)] == [f"{kind}/{mf.MANIFEST_NAME}"]
        mv = client.get_model_version_by_alias(GGUF_MODEL, kind)
        registered = side["registered"]  # the version as the store returned it: an int from SQLite, a str over REST
        assert (registered["name"], str(registered["version"]), registered["alias"]) == (GGUF_MODEL, str(mv.version),
                                                                                          kind), side
        assert mv.tags["variant"] == kind and mv.tags["checkpoint_path"] == str(Path(side["output"]).resolve())
    assert lineage[-1]["label"] == "export" and lineage[-1]["format"] == mf.Format.GGUF_FILE
    assert lineage[-1]["registered"] == f"{GGUF_MODEL}/{stage['side_outputs']['q8_0']['registered']['version']}"
    assert str(Path(hf_output).resolve()) in [n.get("path") for n in lineage], lineage


def test_a_bound_too_tight_for_one_type_fails_the_stage_and_registers_nothing(baton_home, hf_checkpoint):
    r = baton("run", str(TINY), "--from", str(hf_checkpoint), "--stages", "export",
              "--set", "export.types=[f16,q8_0]", "--set", "export.max_logit_rms={q8_0: 1.0e-4}",
              "--set", "data.pretrain_docs=200", "--set", "data.preference_pairs=40", "--set", "data.sft_examples=60",
              home=baton_home, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    stage = next(e for e in summary["stages"] if e["name"] == "export")
    assert (stage["status"], stage["failure"], stage["error"]) == ("failed", "gate", "gate failed: q8_0.gguf.logits")
    failed = [c["name"] for c in stage["gate"]["checks"] if not c["passed"]]
    assert failed == ["q8_0.gguf.logits"] and stage["metrics"]["q8_0_logit_rms"] > 1e-4, stage["gate"]
    assert not any(side.get("registered") for side in stage["side_outputs"].values()), stage["side_outputs"]
    work = Path(stage["log"]).parent
    assert (work / "q8_0.partial" / "model.gguf").exists() and not (work / "q8_0").exists()
    client = mlflow_client(baton_home)
    assert not [m.name for m in client.search_registered_models() if m.name.startswith(GGUF_MODEL)]
