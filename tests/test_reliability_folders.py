"""Hostile checkpoint folders (issue 25, folders): a symlink, a FIFO, a device or a link leading outside the folder fails
L0 naming the entry, the manifest refuses to describe it, and no copy baton makes follows a link (a tokenizer.json
linked to a 0600 file outside was copied into the output)."""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from conversions import folder, hf, manifest as mf, verify

pytestmark = [pytest.mark.fast, pytest.mark.reliability]

SECRET = "the-owner's-private-key"


def _checkpoint(root):
    """A small HF-shaped folder with a manifest written while it held regular files only."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (root / "tokenizer_config.json").write_text("{}")
    mf.write(root, mf.build(root, format="hf-safetensors", stage="test"))
    return root


def _secret(tmp_path):
    path = tmp_path / "outside" / "id_rsa"
    path.parent.mkdir()
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


def _plant(kind, path, tmp_path):
    if kind == "symlink outside":
        path.symlink_to(_secret(tmp_path))
    elif kind == "symlink inside":
        path.symlink_to("config.json")
    elif kind == "symlinked dir outside":
        path.symlink_to(_secret(tmp_path).parent, target_is_directory=True)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: reads without end
    elif kind == "socket":
        socket.socket(socket.AF_UNIX).bind(str(path))


KINDS = ["symlink outside", "symlink inside", "symlinked dir outside", "FIFO", "device", "socket"]


@pytest.mark.parametrize("kind", KINDS)
def test_l0_fails_naming_the_entry(tmp_path, kind, record_property):
    record_property("fault", "checkpoint folder holding a link/FIFO/device")
    root = _checkpoint(tmp_path / "ckpt")
    try:
        _plant(kind, root / "tokenizer.json", tmp_path)
    except PermissionError:
        pytest.skip(f"this user cannot make a {kind}")
    rep = verify.verify(root, levels=("L0",))
    assert not rep["passed"], rep
    detail = rep["checks"][0]["detail"]
    assert "tokenizer.json" in detail and SECRET not in detail, detail
    what = kind.split()[0].replace("symlinked", "symlink")
    assert f"a {what}" in detail, detail
    if kind == "symlink outside":
        assert "outside the folder" in detail
    with pytest.raises(mf.ManifestError, match="tokenizer.json"):
        mf.build(root, format="hf-safetensors", stage="test")


def test_l0_without_a_manifest_still_refuses_a_link(tmp_path, record_property):
    record_property("fault", "checkpoint folder holding a link/FIFO/device")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / "tokenizer.json").symlink_to(_secret(tmp_path))
    rep = verify.verify(root, levels=("L0",))
    assert not rep["passed"] and "tokenizer.json: a symlink" in rep["checks"][0]["detail"], rep


def test_a_linked_tokenizer_is_never_copied(tmp_path, record_property):
    record_property("fault", "tokenizer.json linked to a 0600 file outside")
    src = _checkpoint(tmp_path / "src")
    (src / "tokenizer.json").symlink_to(_secret(tmp_path))
    dst = tmp_path / "out"
    with pytest.raises(folder.UnsafeEntryError, match="tokenizer.json: a symlink"):
        hf.copy_tokenizer(src, dst)
    assert not any(SECRET in f.read_text() for f in dst.rglob("*") if f.is_file())
    with pytest.raises(folder.UnsafeEntryError, match="tokenizer.json: a symlink"):
        folder.copy_tree(src, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_a_fifo_is_refused_by_a_copy_without_blocking(tmp_path, record_property):
    record_property("fault", "checkpoint folder holding a link/FIFO/device")
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(folder.UnsafeEntryError, match="config.json: a FIFO"):
        folder.copy_file(tmp_path / "config.json", tmp_path / "copy.json")


def test_regular_files_copy_with_their_content_and_mode(tmp_path, record_property):
    record_property("fault", "(control) regular files copy and pass L0")
    src = _checkpoint(tmp_path / "src")
    (src / "tokenizer.json").write_text('{"model": {}}')
    (src / "tokenizer.json").chmod(0o640)
    assert hf.copy_tokenizer(src, tmp_path / "out") == ["tokenizer.json", "tokenizer_config.json"]
    copied = tmp_path / "out" / "tokenizer.json"
    assert copied.read_text() == '{"model": {}}' and stat.S_IMODE(copied.stat().st_mode) == 0o640
    assert verify.verify(src, levels=("L0",))["passed"] is False  # tokenizer.json added after the manifest
    mf.write(src, mf.build(src, format="hf-safetensors", stage="test"))
    assert verify.verify(src, levels=("L0",))["passed"]


def test_the_cli_names_the_link_and_writes_nothing(tmp_path, record_property):
    """`baton manifest` and `baton convert` of a folder holding a link: one line naming it, nothing written."""
    record_property("fault", "tokenizer.json linked to a 0600 file outside")
    from conftest import cli

    src = _checkpoint(tmp_path / "src")
    (src / "tokenizer.json").symlink_to(_secret(tmp_path))
    before = (src / mf.MANIFEST_NAME).read_text()
    r = cli("manifest", str(src), home=tmp_path / "home")
    assert r.returncode == 2 and "tokenizer.json: a symlink" in r.stderr and SECRET not in r.stderr, r.stderr
    assert (src / mf.MANIFEST_NAME).read_text() == before
    dst = tmp_path / "dst"
    r = cli("convert", str(src), str(dst), "--from-format", "megatron-dist", home=tmp_path / "home")
    assert r.returncode == 2 and "tokenizer.json: a symlink" in r.stderr and "nothing written" in r.stderr, r.stderr
    assert not dst.exists() and not (tmp_path / "dst.partial").exists()
