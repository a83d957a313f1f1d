"""A stage in the middle of the chain without its input is refused before anything launches. (The data stage's own
run, files and MLflow datasets: tests/test_default_run.py.)"""
from conftest import TINY, cli


def test_midchain_stage_without_input_fails_before_launch(baton_home):
    r = cli("run", str(TINY), "--stages", "rlhf", home=baton_home)
    assert r.returncode == 2
    assert "needs an input checkpoint" in r.stderr and "--from" in r.stderr
    assert not (baton_home / "runs").exists()
