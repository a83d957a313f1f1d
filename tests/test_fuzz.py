"""`make fuzz` in small: mutated real checkpoints of every format through baton's readers in memory-limited workers.
Nothing a mutated file holds may run, kill a worker or hang it; and the canary that says so must trip when the same
payloads do run (plain pickle.loads in the same workers), or "0 executed" would mean nothing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fuzz  # noqa: E402

pytestmark = pytest.mark.fast


def test_600_mutated_checkpoints_run_nothing_kill_no_worker_and_hang_none(tmp_path):
    s = fuzz.run(600, 7, tmp_path, workers=2)
    print(fuzz.format_table(s))
    not_caught = [name for name, found in s["control"].items() if not any(f.endswith("CANARY created") for f in found)]
    assert len(s["control"]) == len(fuzz.CODE_RUNNING) and not not_caught, \
        f"payloads that ran through plain pickle.loads without the canary noticing: {not_caught}"
    assert s["cases"] == 600 and set(s["table"]) == set(fuzz.TARGETS)
    assert s["by_mutation"]["pickle splice"].get("refused", 0) > 0
    assert (s["executed"], s["signals"], s["worker_exits"], s["hangs"]) == (0, 0, 0, 0), s["findings"][:5]
