"""Retraining remembers what it decided: a candidate kept for one champion version and data digest is found again in
MLflow (a real SQLite store), so the nightly run does not repeat the same fine-tune; and `better` reads losses the
right way round. No engine starts."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.fast


def test_kept_decision_is_found_for_the_same_champion_and_data_only(baton_home):
    from flows.config import PipelineConfig
    from flows.retrain import DECISION_TAG, already_kept
    from tasks import tracking

    cfg = PipelineConfig(name="retrain", stages=["finetune"])
    c = tracking.client()
    assert already_kept(c, cfg, "3", "abc") is None  # no experiment yet
    run = tracking.start_run(c, cfg.tracking.experiment, "retrain-decision-1",
                             tags={DECISION_TAG: "kept", "baton.data_digest": "abc", "baton.champion_version": "3"})
    tracking.end_run(c, run, True)
    other = tracking.start_run(c, cfg.tracking.experiment, "retrain-decision-2",
                               tags={DECISION_TAG: "promoted", "baton.data_digest": "def",
                                     "baton.champion_version": "3"})
    tracking.end_run(c, other, True)
    assert already_kept(c, cfg, "3", "abc") == run
    assert already_kept(c, cfg, "4", "abc") is None   # a new champion: try again
    assert already_kept(c, cfg, "3", "def") is None   # promoted, not kept
    assert already_kept(c, cfg, "3", "xyz") is None   # new data


def test_better_reads_losses_and_scores_the_right_way_round():
    from flows.retrain import better

    assert better(0.8, 0.5, 0.2, "heldout_exact_match") and not better(0.6, 0.5, 0.2, "heldout_exact_match")
    assert better(1.0, 1.5, 0.2, "heldout_loss") and not better(1.4, 1.5, 0.2, "heldout_loss")
    assert not better(None, 1.5, 0.0, "heldout_loss")
