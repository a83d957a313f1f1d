"""`baton import gguf:PATH DEST` on hostile GGUF files: each is refused by the structure walk with one line naming the
file and what is wrong, before the gguf package's reader sees it (that reader follows a header's counts blindly: an
array of 2^40 one-byte items past the end of a 60-byte file keeps it looping and allocating). Nothing is written.
The real model's import is tests/test_real_model.py (marker long)."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from conftest import cli

pytestmark = pytest.mark.fast


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_string(key: str, value: str) -> bytes:
    return _str(key) + struct.pack("<I", 8) + _str(value)


def kv_u8_array(key: str, items: int) -> bytes:
    return _str(key) + struct.pack("<IIQ", 9, 0, items)


def tensor_info(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    return _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type,
                                                                                                       offset)


def gguf_file(path: Path, kvs: list[bytes], tensors: list[bytes] = (), body: bytes = b"") -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors) + body)
    return path


ARCH = kv_string("general.architecture", "llama")
CASES = {
    # the reader loops 2^40 times over nothing, appending an empty array each time (minutes, then memory)
    "endless_array": ([ARCH, kv_u8_array("tokenizer.ggml.token_type", 1 << 40)], [],
                      "tokenizer.ggml.token_type: an array of 1099511627776 items (the limit is 16777216)"),
    "string_past_the_end": ([ARCH, _str("general.name") + struct.pack("<IQ", 8, 1 << 40)], [],
                            "general.name at byte"),
    "tensor_past_the_end": ([ARCH], [tensor_info("token_embd.weight", [64, 4], 0, 0)],
                            "tensor token_embd.weight: its 1024 bytes at offset 0 lie past the end of the file"),
    "five_dimensions": ([ARCH], [tensor_info("blk.0.attn_q.weight", [2, 2, 2, 2, 2], 0, 0)],
                        "tensor blk.0.attn_q.weight: 5 dimensions (1 to 4)"),
    "unknown_value_type": ([ARCH, _str("general.x") + struct.pack("<I", 77)], [], "general.x: unknown value type 77"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_gguf_is_refused_before_any_reader_and_nothing_is_written(tmp_path, baton_home, case):
    kvs, tensors, expected = CASES[case]
    evil = gguf_file(tmp_path / f"{case}.gguf", kvs, tensors)
    dest = tmp_path / "out" / "model"
    started = time.monotonic()
    r = cli("import", f"gguf:{evil}", str(dest), home=baton_home)
    assert r.returncode == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"baton import: {evil}: ") and expected in line, line
    assert time.monotonic() - started < 10
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # no checkpoint, no partial, no private copy


def test_not_a_gguf_file_and_no_file_are_named(tmp_path, baton_home):
    pickle_file = tmp_path / "model.gguf"
    pickle_file.write_bytes(b"\x80\x04\x95" + b"\x00" * 64)  # a pickle stream is never read as one
    r = cli("import", f"gguf:{pickle_file}", str(tmp_path / "a"), home=baton_home)
    assert r.returncode == 2 and "not a GGUF file" in r.stderr, r.stderr
    r = cli("import", f"gguf:{tmp_path / 'absent.gguf'}", str(tmp_path / "b"), home=baton_home)
    assert r.returncode == 2 and "absent.gguf: not a file" in r.stderr, r.stderr
    r = cli("import", str(pickle_file), str(tmp_path / "c"), home=baton_home)
    assert r.returncode == 2 and "expected gguf:PATH" in r.stderr, r.stderr


def test_from_gguf_names_the_refusal_before_anything_launches(tmp_path, baton_home):
    from conftest import TINY

    kvs, _, expected = CASES["endless_array"]
    evil = gguf_file(tmp_path / "evil.gguf", kvs)
    r = cli("config", str(TINY), "--stages", "rlhf", "--from", f"gguf:{evil}", home=baton_home)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert expected in r.stderr and f"gguf:{evil}" not in r.stdout, r.stderr
    assert not list((baton_home / "imports").iterdir())
