"""Seals that prove who wrote them (issue 25, item 7): whoever can write a step folder could replace the files and their
sha256 in the seal together, and resume or conversion trusted it. A seal now carries an HMAC under the BATON_HOME's
private key: a forged or re-digested seal is refused before any loader reads the folder."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from conversions import sealed

pytestmark = [pytest.mark.fast, pytest.mark.reliability]


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("BATON_HOME", str(home))
    monkeypatch.delenv(sealed.KEY_ENV, raising=False)
    return home


def _sealed_folder(folder, marker, payload=b"\x01" * 4096, **facts):
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(payload)
    sealed.seal(folder, marker, **facts)
    return folder


def _forge(folder, marker, payload):
    """What an attacker who can write the folder does: new bytes, and the seal's digests recomputed to match."""
    (folder / "__0_0.distcp").write_bytes(payload)
    body = json.loads((folder / marker).read_text())
    body["sha256"] = dict(zip(body["sha256"], [sealed.mf.sha256_file(folder / n, reuse=False) for n in body["sha256"]]))
    (folder / marker).write_text(json.dumps(body))


def test_a_redigested_seal_is_refused(home, tmp_path, record_property):
    record_property("fault", "checkpoint files and seal replaced together")
    folder = _sealed_folder(tmp_path / "ckpt", "baton_complete.json", step=2)
    assert sealed.problem(folder, "baton_complete.json") is None
    _forge(folder, "baton_complete.json", b"\x66" * 4096)
    assert "HMAC does not verify" in sealed.problem(folder, "baton_complete.json")
    body = json.loads((folder / "baton_complete.json").read_text())
    del body["hmac"]
    (folder / "baton_complete.json").write_text(json.dumps(body))
    assert "carries no HMAC" in sealed.problem(folder, "baton_complete.json")


def test_a_seal_from_another_baton_home_is_refused(home, tmp_path, monkeypatch, record_property):
    record_property("fault", "checkpoint files and seal replaced together")
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "elsewhere"))
    folder = _sealed_folder(tmp_path / "ckpt", "baton_complete.json", step=2)
    monkeypatch.setenv("BATON_HOME", str(home))
    assert "HMAC does not verify" in sealed.problem(folder, "baton_complete.json")


def test_megatron_resume_skips_a_forged_checkpoint(home, tmp_path, record_property):
    record_property("fault", "checkpoint files and seal replaced together")
    pytest.importorskip("megatron.core")
    from tasks import resuming
    from tasks.pretrain import mcore_checkpoint as ckpt

    for it in (1, 2):
        _sealed_folder(tmp_path / f"{ckpt.PREFIX}{it:07d}", ckpt.STATE_FILE, bytes([it]) * 4096, iteration=it)
    _forge(tmp_path / f"{ckpt.PREFIX}0000002", ckpt.STATE_FILE, b"\x66" * 4096)
    point = resuming.resume_point(tmp_path, ckpt.KIND)
    assert point.checkpoint.name == f"{ckpt.PREFIX}0000001"
    assert "HMAC does not verify" in point.rejected[0].reason and not (tmp_path / f"{ckpt.PREFIX}0000002").exists()


def test_the_convert_step_refuses_a_forged_deepspeed_checkpoint(home, tmp_path, record_property):
    record_property("fault", "checkpoint files and seal replaced together")
    from tasks.convert.worker import refuse_unsealed

    root = tmp_path / "checkpoint"
    _sealed_folder(root / "global_step4", sealed.MARKERS["deepspeed-zero"], step=4)
    (root / "latest").write_text("global_step4")
    refuse_unsealed(root, "deepspeed-zero")  # the stage's own seal verifies
    _forge(root / "global_step4", sealed.MARKERS["deepspeed-zero"], b"\x66" * 4096)
    with pytest.raises(SystemExit, match=r"global_step4: its seal's HMAC does not verify.*not converting it"):
        refuse_unsealed(root, "deepspeed-zero")


def test_the_key_is_private_made_once_and_checked(home, record_property):
    record_property("fault", "seal key shared or swapped")
    path = sealed.ensure_key()
    assert path == home / "seal.key" and stat.S_IMODE(path.stat().st_mode) == 0o600
    key = sealed.read_key()
    assert sealed.ensure_key() == path and sealed.read_key() == key  # never replaced
    assert not [p for p in home.iterdir() if p.name.endswith(".tmp")]
    path.chmod(0o644)
    with pytest.raises(sealed.SealKeyError, match=r"seal.key: must be a regular file .* mode 0600 .*mode 644"):
        sealed.read_key()
    path.chmod(0o600)
    path.rename(home / "real.key")
    os.symlink(home / "real.key", path)
    with pytest.raises(sealed.SealKeyError, match="symlink is refused"):
        sealed.read_key()


def test_workers_get_the_key_path_not_the_key(home, tmp_path):
    from tasks.stage import StageContext

    ctx = StageContext(stage="finetune", run_id="t", run_dir=tmp_path, work_dir=tmp_path, model={}, seed=0)
    env = ctx.worker_env()
    assert env[sealed.KEY_ENV] == str(home / "seal.key")
    assert sealed.read_key().hex() not in json.dumps(env)


def test_the_pipeline_s_convert_step_refuses_before_any_loader(home, tmp_path, monkeypatch, record_property):
    """The convert step of a run, fed a finetune output whose seal was written with another key: the worker stops at
    the seal (the step fails naming it), and no output is published."""
    record_property("fault", "checkpoint files and seal replaced together")
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert
    from tasks.stage import StageContext

    monkeypatch.setenv("BATON_HOME", str(tmp_path / "attacker-home"))
    src = tmp_path / "finetune-output"
    _sealed_folder(src / "global_step4", sealed.MARKERS["deepspeed-zero"], step=4)
    (src / "latest").write_text("global_step4")
    monkeypatch.setenv("BATON_HOME", str(home))
    ctx = StageContext(stage="convert", run_id="t", run_dir=tmp_path, work_dir=tmp_path / "work", model={}, seed=0,
                       input=src, input_format="deepspeed-zero", runtimes={"main": {"python": sys.executable}},
                       extra={"from_format": "deepspeed-zero", "to_format": "hf-safetensors", "source_stage": "finetune"})
    with pytest.raises(Exception, match="global_step4: its seal's HMAC does not verify"):
        run_convert.fn(ctx, ConvertConfig())
    assert not (tmp_path / "work" / "checkpoint").exists()
