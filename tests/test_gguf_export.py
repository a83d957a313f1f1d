"""`baton export CKPT DEST --type f16|q8_0|q4_K_M`: llama.cpp's own converter (the llamacpp runtime) writes the GGUF
file (q4_K_M: llama-quantize from the converter's f16), baton's restricted reader reads it back and the gate compares it with the source checkpoint (tensor types, shape keys,
vocabulary, special tokens, chat template, logits of the dequantised weights) before DEST is published. Each export
of the tiny model takes a few seconds; the three good ones are shared by the tests below."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import cli

# `fast` for the refusals made before anything runs; the others start the converter in the llamacpp runtime.


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("baton-home")


@pytest.fixture(scope="module")
def exports(tmp_path_factory, hf_checkpoint, home):
    """{type: (completed `baton export`, DEST)} for f16, q8_0 and q4_K_M of the tiny checkpoint."""
    root = tmp_path_factory.mktemp("exports")
    return {kind: (cli("export", str(hf_checkpoint), str(root / kind), "--type", kind, home=home), root / kind)
            for kind in ("f16", "q8_0", "q4_K_M")}


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_K_M"])
def test_an_export_passes_its_gate_and_is_published_with_its_manifest(exports, hf_checkpoint, kind):
    from conversions import manifest as mf

    r, dest = exports[kind]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ok] gguf.logits" in r.stdout and "[ok] gguf.chat_template" in r.stdout and "PASSED" in r.stdout
    m = mf.read(dest)
    assert m["format"] == mf.Format.GGUF_FILE and m["extra"]["gguf_type"] == kind
    assert m["parent"]["digest"] == mf.digest_of(mf.read(hf_checkpoint))
    assert sorted(f["path"] for f in m["files"]) == ["Modelfile", "model.gguf"]
    assert m["extra"]["modelfile"] == "chatml" and (dest / "Modelfile").read_text().startswith("FROM ./model.gguf\n")
    assert not (dest.parent / f"{kind}.partial").exists()


def test_q8_0_is_smaller_and_looser_than_f16_and_q4_K_M_smaller_still(exports):
    from conversions import manifest as mf

    f16, q8, q4 = (mf.read(exports[k][1])["extra"] for k in ("f16", "q8_0", "q4_K_M"))
    assert q4["size"] < q8["size"] < 0.7 * f16["size"]
    assert f16["logit_rms"] < q8["logit_rms"] < q4["logit_rms"] and f16["argmax_agreement"] == 1.0


def test_q4_K_M_is_llama_quantize_s_mix(exports):
    """The tiny model's rows (128, 344 wide) are no whole number of Q4_K's 256-blocks: llama-quantize falls back per
    tensor (Q5_0 for Q4_K, Q8_0 for Q6_K, F16 where 32 does not divide the row either), and the gate accepts the mix."""
    from conversions import manifest as mf

    r, dest = exports["q4_K_M"]
    assert "llama-quantize Q4_K_M" in mf.read(dest)["engine"]["converter"]
    assert "[ok] gguf.tensor_types" in r.stdout and "Q5_0" in r.stdout, r.stdout


def test_baton_verify_reruns_the_gate_and_catches_a_changed_byte(exports, home, tmp_path):
    r = cli("verify", str(exports["f16"][1]), home=home)
    assert r.returncode == 0 and "[ok] gguf.logits" in r.stdout, r.stdout + r.stderr
    copy = shutil.copytree(exports["f16"][1], tmp_path / "copy")
    gguf_file = copy / "model.gguf"
    data = bytearray(gguf_file.read_bytes())
    data[-100] ^= 0xFF
    gguf_file.write_bytes(bytes(data))
    r = cli("verify", str(copy), home=home)
    assert r.returncode == 1 and "[FAIL] L0.integrity" in r.stdout, r.stdout


def _tensor_bytes(path, name):
    """(offset, length) of a tensor's data in a GGUF file, as the structure walk finds it."""
    from conversions import gguf

    source = gguf.check_structure(gguf.Source(path, "", path.stat().st_size), path)
    t = next(t for t in source.tensors if t.name == name)
    return source.data_start + t.offset, t.nbytes


def test_the_gate_refuses_tampered_weights_and_a_truncated_file(exports, hf_checkpoint, tmp_path):
    import numpy as np

    from conversions import gguf_export

    tampered = shutil.copy(exports["f16"][1] / "model.gguf", tmp_path / "tampered.gguf")
    start, n = _tensor_bytes(tampered, "blk.0.ffn_down.weight")
    data = bytearray(tampered.read_bytes())
    weights = np.frombuffer(bytes(data[start:start + n]), dtype=np.float16) * np.float16(3.0)  # one matrix scaled
    data[start:start + n] = weights.astype(np.float16).tobytes()
    tampered.write_bytes(bytes(data))
    rep = gguf_export.gate(tampered, hf_checkpoint, "f16")
    assert not rep["passed"] and [c["name"] for c in rep["checks"] if not c["passed"]] == ["gguf.logits"], rep

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tampered.read_bytes()[:-4096])
    rep = gguf_export.gate(truncated, hf_checkpoint, "f16")
    assert not rep["passed"] and rep["checks"][0]["name"] == "gguf.structure" and "past the end" in rep["checks"][0]["detail"]


def test_a_changed_chat_template_is_named(exports, hf_checkpoint, tmp_path):
    """The GGUF against a source whose chat template differs (one comment added): the header check names it."""
    from conversions import gguf_export

    src = shutil.copytree(hf_checkpoint, tmp_path / "src")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    template = src / "chat_template.jinja"
    if template.exists():
        template.write_text(template.read_text() + "{# changed #}")
    else:
        cfg["chat_template"] = (cfg.get("chat_template") or "") + "{# changed #}"
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    rep = gguf_export.gate(exports["f16"][1] / "model.gguf", src, "f16")
    failed = {c["name"]: c["detail"] for c in rep["checks"] if not c["passed"]}
    assert set(failed) == {"gguf.chat_template"}, rep


@pytest.mark.parametrize("kind", ["q8_0", "q4_K_M"])
def test_a_too_lossy_export_is_refused_and_nothing_published(hf_checkpoint, home, tmp_path, kind):
    """A bound tighter than the type's error (q4_K_M's measured rms is ~1e-1 of the logits' std on the tiny model)."""
    dest = tmp_path / kind
    r = cli("export", str(hf_checkpoint), str(dest), "--type", kind, "--max-logit-rms", "1e-3", home=home)
    assert r.returncode == 1 and "[FAIL] gguf.logits" in r.stdout and "the gate failed" in r.stderr, r.stdout + r.stderr
    assert not dest.exists() and (tmp_path / f"{kind}.partial" / "model.gguf").exists()


@pytest.mark.fast
def test_an_unknown_type_is_refused_naming_the_known_ones(hf_checkpoint, home, tmp_path):
    r = cli("export", str(hf_checkpoint), str(tmp_path / "iq2"), "--type", "iq2_xs", home=home)
    assert r.returncode == 2 and "iq2_xs" in r.stderr and "q4_K_M" in r.stderr, r.stderr
    assert not (tmp_path / "iq2").exists() and not (tmp_path / "iq2.partial").exists()


@pytest.mark.fast
def test_a_source_that_is_not_hf_is_refused_before_anything_runs(data_dir, home, tmp_path):
    r = cli("export", str(data_dir), str(tmp_path / "out"), home=home)
    assert r.returncode == 2 and "export reads hf-safetensors" in r.stderr and "baton convert" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
