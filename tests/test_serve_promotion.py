"""The `champion` alias in the real MLflow registry: promotion keeps the replaced version, rollback walks back."""
from __future__ import annotations

import pytest

from conftest import cli
from tasks import tracking


def test_promote_and_rollback_chain(tmp_path, baton_home):
    c = tracking.client()
    versions = []
    for i in range(3):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        versions.append(tracking.register_checkpoint(c, "chain", folder, None, tags={"i": i}, alias=None))
    v1, v2, v3 = map(str, versions)
    assert tracking.promote_champion(c, "chain", v1)["previous"] is None
    assert tracking.promote_champion(c, "chain", v2)["previous"] == v1
    again = tracking.promote_champion(c, "chain", v2)  # re-serving the champion changes nothing
    assert again["changed"] is False and again["previous"] == v1
    assert tracking.promote_champion(c, "chain", v3)["previous"] == v2
    assert str(c.get_model_version_by_alias("chain", "previous-champion").version) == v2

    assert tracking.rollback_champion(c, "chain") == {"name": "chain", "from": v3, "to": v2}
    assert str(c.get_model_version_by_alias("chain", "champion").version) == v2
    assert str(c.get_model_version_by_alias("chain", "previous-champion").version) == v1
    assert tracking.rollback_champion(c, "chain") == {"name": "chain", "from": v2, "to": v1}
    with pytest.raises(ValueError, match="first champion"):
        tracking.rollback_champion(c, "chain")
    assert len(c.search_model_versions("name = 'chain'")) == 3  # nothing is ever deleted
    with pytest.raises(ValueError, match="no 'champion' alias"):
        tracking.rollback_champion(c, "unknown-model")


def test_baton_rollback_moves_the_alias_back_and_marks_the_replaced_version(tmp_path, baton_home):
    c = tracking.client()
    versions = []
    for i in range(2):
        (tmp_path / f"v{i}").mkdir()
        versions.append(str(tracking.register_checkpoint(c, "served", tmp_path / f"v{i}", None, tags={}, alias=None)))
        tracking.promote_champion(c, "served", versions[-1])
    first, second = versions
    r = cli("rollback", "served", home=baton_home)
    assert r.returncode == 0, r.stderr
    assert f"from version {second} to version {first}" in r.stdout
    assert str(c.get_model_version_by_alias("served", "champion").version) == first
    assert c.get_model_version("served", second).tags["baton.rolled_back"] == "true"
    r = cli("rollback", "served", home=baton_home)
    assert r.returncode == 1 and "first champion" in r.stderr
