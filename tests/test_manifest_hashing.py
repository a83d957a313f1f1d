"""L0 hashing: streamed sha256 over several files in parallel, and no second read of a file this process already
hashed unless anything about it changed since (size, mtime, ctime, inode)."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from conversions import manifest as mf, verify

pytestmark = pytest.mark.fast


def _settled(path, data: bytes):
    path.write_bytes(data)
    time.sleep(mf._RACY_NS / 1e9 + 0.05)  # past the window in which a write could share its timestamp with a hash
    return path


def test_parallel_digests_equal_hashlib_in_the_given_order(tmp_path):
    files = [_settled(tmp_path / f"f{i}", os.urandom(n)) for i, n in enumerate([10, (9 << 20) + 7, 0, 3 << 20])]
    assert mf.sha256_files(files, threads=3) == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]


def test_an_unchanged_file_is_not_read_again(tmp_path):
    f = _settled(tmp_path / "w.bin", os.urandom(1 << 20))
    digest = mf.sha256_file(f)
    assert mf._DIGESTS[mf._stat_key(os.stat(f))] == digest
    assert mf.sha256_file(f) == digest


def test_a_flipped_byte_with_its_mtime_restored_is_still_caught(tmp_path):
    f = _settled(tmp_path / "model.safetensors", os.urandom(1 << 20))
    (tmp_path / "config.json").write_text("{}")
    mf.write(tmp_path, mf.build(tmp_path, format="hf-safetensors", stage="test"))
    st = os.stat(f)
    data = bytearray(f.read_bytes())
    data[-100] ^= 1
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the ctime tells
    [check] = verify.integrity(tmp_path)
    assert not check["passed"] and "model.safetensors: sha256 mismatch" in check["detail"]


def test_a_file_rewritten_right_after_hashing_is_hashed_again(tmp_path):
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"a" * 4096)
    first = mf.sha256_file(f)  # written moments ago: racy, so not remembered
    f.write_bytes(b"b" * 4096)
    assert mf.sha256_file(f) != first == hashlib.sha256(b"a" * 4096).hexdigest()
