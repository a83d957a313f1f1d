"""Issue 25: `baton run --from` a Megatron torch_dist checkpoint baton did not write. Baton's restricted reader parses
its `.metadata` and sees engine records only as inert placeholders; Megatron's loader (torch.distributed.checkpoint)
unpickles the same file again with plain pickle, which calls them. A crafted `.metadata` that passes the one and runs
code in the other must never reach Megatron: the pretrain stage starts from baton's own rewrite of the weights."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from conftest import TINY, cli
from test_hostile_loader import plant_plain_pickle_payload

pytestmark = [pytest.mark.slow, pytest.mark.reliability]
SHORT = ["pretrain.steps=2", "pretrain.warmup_steps=1", "pretrain.checkpoint_every=2", "pretrain.eval_interval=2"]


def _foreign_checkpoint(dest: Path, hf_checkpoint: Path, canary: Path) -> Path:
    """A Megatron checkpoint from elsewhere (no seal of this BATON_HOME), its `.metadata` carrying the payload."""
    from conversions import manifest as mf, megatron

    info = megatron.from_hf(hf_checkpoint, dest)
    plant_plain_pickle_payload(dest, canary)
    mf.write(dest, mf.build(dest, format="megatron-dist", stage="external", architecture=info["architecture"],
                            parent=mf.parent_ref(hf_checkpoint), tokenizer_dir=dest / "tokenizer"))
    return dest


def test_a_crafted_metadata_passed_as_from_never_reaches_megatron(tmp_path, baton_home, hf_checkpoint,
                                                                 record_property):
    record_property("fault", "crafted .metadata that only plain pickle runs, as --from")
    from conversions import megatron

    canary = tmp_path / "canary"
    src = _foreign_checkpoint(tmp_path / "foreign", hf_checkpoint, canary)
    assert megatron.architecture(src)["num_layers"] == 4 and not canary.exists()  # baton's reader accepts it inertly

    r = cli("run", str(TINY), "--stages", "pretrain", "--from", str(src), *(f"--set={s}" for s in SHORT),
            home=baton_home)
    assert not canary.exists(), "Megatron unpickled the --from checkpoint's .metadata"
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads(next((baton_home / "runs").glob("*/summary.json")).read_text())
    pretrain = next(s for s in summary["stages"] if s["name"] == "pretrain")
    assert "not sealed by this BATON_HOME" in pretrain["input_rewritten"], pretrain
    assert {c["name"]: c["passed"] for c in pretrain["gate"]["checks"]}["L2.input_parity"]  # the same weights

    pickle.loads((src / ".metadata").read_bytes()).planner_notes.close()  # the control: plain pickle runs it
    assert canary.exists()
