"""The champion alias moves by compare-and-set (issue 12, item 2), in the real MLflow registry, from real concurrent
processes: of two promotions decided against the same champion exactly one lands; a decision made against a champion
that has moved since is refused with a message, and changes nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from tasks import tracking

pytestmark = pytest.mark.reliability

PROMOTE = """
import sys, time
sys.path.insert(0, {repo!r})
from tasks import tracking
c = tracking.client()
while time.time() < {start}:
    time.sleep(0.01)
try:
    tracking.promote_champion(c, "race", {version!r}, expected={expected!r})
    print("promoted")
except tracking.AliasMoved as e:
    print("refused:", e)
"""


def _versions(tmp_path, n):
    c = tracking.client()
    out = []
    for i in range(n):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        out.append(str(tracking.register_checkpoint(c, "race", folder, None, tags={"i": i}, alias=None)))
    return c, out


@pytest.mark.slow
def test_two_concurrent_promotions_exactly_one_lands(tmp_path, baton_home, record_property):
    record_property("fault", "concurrent champion promotions")
    c, (v1, v2, v3) = _versions(tmp_path, 3)
    tracking.promote_champion(c, "race", v1)
    start = time.time() + 8  # both processes are up and waiting by then
    procs = [subprocess.Popen([sys.executable, "-c", PROMOTE.format(repo=str(REPO), start=start, version=v,
                                                                    expected=v1)],
                              env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for v in (v2, v3)]
    outs = [p.communicate(timeout=120) for p in procs]
    lines = [o.strip().splitlines()[-1] if o.strip() else e[-500:] for o, e in outs]
    assert sorted(line.split(":")[0] for line in lines) == ["promoted", "refused"], lines
    winner = (v2, v3)[[line == "promoted" for line in lines].index(True)]
    assert str(c.get_model_version_by_alias("race", "champion").version) == winner
    assert str(c.get_model_version_by_alias("race", "previous-champion").version) == v1
    assert "moved since this decision was made" in next(line for line in lines if line.startswith("refused"))


@pytest.mark.fast
def test_stale_decision_and_rollback_are_refused(tmp_path, baton_home, record_property):
    record_property("fault", "stale champion decision")
    c, (v1, v2, v3) = _versions(tmp_path, 3)
    tracking.promote_champion(c, "race", v1)
    decided_against = v1  # a retrain reads the champion, then trains for hours ...
    tracking.promote_champion(c, "race", v2, expected=v1)  # ... while someone else promotes
    with pytest.raises(tracking.AliasMoved, match=f"expected version {v1}, now {v2}"):
        tracking.promote_champion(c, "race", v3, expected=decided_against)
    with pytest.raises(tracking.AliasMoved):
        tracking.rollback_champion(c, "race", expected=v3)
    assert str(c.get_model_version_by_alias("race", "champion").version) == v2
    assert tracking.rollback_champion(c, "race", expected=v2)["to"] == v1
