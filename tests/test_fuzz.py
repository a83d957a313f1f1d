"""`make fuzz` in small: mutated real checkpoints of every format through baton's readers in memory-limited workers.
Nothing a mutated file holds may run, kill a worker or hang it, no reader may raise anything but a refusal, and no
changed sealed or manifested file may be accepted; the canary that says nothing ran must trip when the same payloads
do run (plain pickle.loads in the same workers), and the whole check must fail on a planted broken reader."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fuzz  # noqa: E402

pytestmark = pytest.mark.fast
PLANTED = Path(__file__).resolve().parent / "fuzz_planted.py"


def check(s: dict) -> None:
    """What the in-suite fuzz asserts of a run: the same verdict as `make fuzz`, and every format and the canary used."""
    not_caught = [name for name, found in s["control"].items() if not any(f.endswith("CANARY created") for f in found)]
    assert len(s["control"]) == len(fuzz.CODE_RUNNING) and not not_caught, \
        f"payloads that ran through plain pickle.loads without the canary noticing: {not_caught}"
    assert set(s["table"]) == set(fuzz.TARGETS)
    assert s["by_mutation"]["pickle splice"].get("refused", 0) > 0
    assert fuzz.failures(s) == [], s["findings"][:5]


def test_600_mutated_checkpoints_run_nothing_raise_nothing_unexpected_and_accept_no_change(tmp_path):
    s = fuzz.run(600, 7, tmp_path, workers=2)
    print(fuzz.format_table(s))
    assert s["cases"] == 600
    check(s)
    assert s["table"]["seal"].get("refused", 0) > 0 and s["table"]["manifest"].get("refused", 0) > 0


def test_a_planted_careless_reader_fails_make_fuzz_and_the_in_suite_check(tmp_path):
    result = tmp_path / "fuzz.json"
    code = fuzz.main(["--cases", "120", "--seed", "7", "--out", str(tmp_path / "work"), "--result", str(result),
                      "--reader", f"{PLANTED}:careless_reader"])
    s = json.loads(result.read_text())
    # the planted faults happened: numpy's bare ValueError on safetensors files, changed seals read as fine
    assert s["unexpected"].get("ValueError", 0) == s["table"]["safetensors"]["unexpected"] > 0
    assert any(w.startswith("ValueError from numpy.lib.") for w in s["unexpected_where"])
    assert s["accepted"] == s["table"]["seal"]["accepted"] > 0
    assert code == 1
    with pytest.raises(AssertionError):
        check(s)


def test_only_baton_refusals_and_listed_library_parse_errors_count_as_refused(tmp_path):
    from safetensors import SafetensorError

    from conversions import hf
    from conversions.refusal import Refused

    with pytest.raises(ValueError) as numpy_error:  # raised in numpy's own Python code
        np.lib.format.read_magic(io.BytesIO(b"not an npy file"))
    assert fuzz.origin(numpy_error.value).startswith("numpy.lib.")
    assert fuzz.classify(numpy_error.value) == "unexpected"
    assert fuzz.classify(ValueError("anything")) == "unexpected"
    assert fuzz.classify(Refused("x: refused")) == "refused"
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'  # 16 bytes promised, none there
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(SafetensorError) as lib_error:
        list(hf.iter_tensors(tmp_path))
    assert fuzz.classify(lib_error.value) == "refused", fuzz.origin(lib_error.value)


def test_a_seal_with_one_byte_of_whitespace_dropped_is_refused(tmp_path, monkeypatch):
    """The case `make fuzz` once counted as `seal: loaded 1`: a seal whose bytes changed but whose JSON means the same
    (its HMAC covers the meaning); the seal must be the exact text baton writes."""
    from conversions import sealed

    monkeypatch.setenv(sealed.KEY_ENV, str(tmp_path / "seal.key"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "weights.bin").write_bytes(b"w" * 64)
    sealed.seal(tmp_path / "ckpt", "baton_complete.json", step=3)
    assert sealed.problem(tmp_path / "ckpt", "baton_complete.json") is None
    marker = tmp_path / "ckpt" / "baton_complete.json"
    text = marker.read_text()
    edited = text.replace('\n  "step"', '\n "step"', 1)
    assert edited != text and json.loads(edited) == json.loads(text)
    marker.write_text(edited)
    assert sealed.problem(tmp_path / "ckpt", "baton_complete.json") == \
        "baton_complete.json is not the text baton wrote (its meaning verifies, its bytes were edited)"


@pytest.mark.parametrize("doc", ["README.md", "docs/index.md", "docs/getting-started.md"])
def test_the_quoted_fuzz_figures_are_the_harness_s_own_output(doc):
    result = json.loads(fuzz.RESULT.read_text())
    assert fuzz.failures(result) == [], "the committed whole run fails its own check"
    assert fuzz.readme_line(result) in (fuzz.REPO / doc).read_text()


def test_the_reliability_page_shows_the_committed_run_as_the_harness_prints_it():
    result = json.loads(fuzz.RESULT.read_text())
    assert fuzz.docs_block(result) in (fuzz.REPO / "docs" / "reliability-and-security.md").read_text()
