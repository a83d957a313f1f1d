"""`baton export --type w8a8|w4a16`: llm-compressor (the llmcompressor runtime) quantizes the tiny checkpoint for vLLM,
calibrated on the data stage's own pretraining rows; the gate compares the written folder's held-out loss with the
source's before anything is published; vLLM's CPU build serves W8A8 and refuses, before any server starts, a scheme it
has no kernel for (naming it, with the GPU recipe). One w8a8 export (8 calibration rows, ~2-3 min on a loaded
2-core machine) is shared by the tests below."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import TINY, baton, cli, mlflow_client

ROWS = 8


@pytest.fixture(scope="module")
def w8a8_export(tmp_path_factory, hf_checkpoint, data_dir):
    """(completed `baton export --type w8a8`, DEST)."""
    root = tmp_path_factory.mktemp("quant")
    dest = root / "w8a8"
    r = cli("export", str(hf_checkpoint), str(dest), "--type", "w8a8", "--calibration", str(data_dir),
            "--calibration-rows", str(ROWS), home=root / "home")
    return r, dest


@pytest.fixture(scope="module")
def w4a16_export(tmp_path_factory, tiny_config, data_dir):
    """(completed `baton export --type w4a16`, DEST, its source): the tiny architecture with ffn_hidden_size 384 (a
    multiple of W4A16's groups of 128 and of vLLM's CPU 4-bit kernel's 32; the tiny model's 344 is neither), random
    init."""
    from conversions import hf, manifest as mf
    from conftest import make_hf_checkpoint

    root = tmp_path_factory.mktemp("w4a16")
    arch = {**tiny_config.model.model_dump(), "ffn_hidden_size": 384}
    src = make_hf_checkpoint(root / "ckpt", arch, data_dir / "tokenizer")
    mf.write(src, mf.build(src, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(src),
                           dtype="float32", architecture=arch))
    dest = root / "w4a16"
    r = cli("export", str(src), str(dest), "--type", "w4a16", "--calibration", str(data_dir),
            "--calibration-rows", str(ROWS), home=root / "home")
    return r, dest, src


def published(r, dest: Path, parent: Path, type_name: str) -> dict:
    """The export's three gate checks passed and its manifest names the scheme, the parent and a held-out loss
    delta within the type's bound; the manifest."""
    from conversions import manifest as mf, vllm_quant

    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("quant.scheme", "quant.coverage", "quant.heldout_loss"):
        assert f"[ok] {name}" in r.stdout, r.stdout
    m = mf.read(dest)
    assert m["format"] == mf.Format.COMPRESSED_TENSORS and m["extra"]["scheme"] == type_name.upper()
    assert m["parent"]["digest"] == mf.digest_of(mf.read(parent))
    assert abs(m["extra"]["loss_delta"]) <= vllm_quant.TYPES[type_name].max_loss_delta
    return m


def test_w8a8_passes_its_gate_and_is_published_with_its_calibration_digest(w8a8_export, hf_checkpoint, data_dir):
    from conversions import vllm_quant

    r, dest = w8a8_export
    m = published(r, dest, hf_checkpoint, "w8a8")
    rows = [json.loads(line)["text"] for line in (data_dir / "pretrain" / "train.jsonl").read_text().splitlines()]
    calibration = m["extra"]["calibration"]
    assert calibration["rows"] == ROWS
    assert calibration["sha256"] == hashlib.sha256("\n".join(rows[:ROWS]).encode()).hexdigest()
    assert m["extra"]["size"] < 0.5 * m["extra"]["source_size"]  # int8 matrices; embeddings and lm_head stay fp32
    config = json.loads((dest / "config.json").read_text())
    assert vllm_quant.scheme_of(config) == "W8A8" and "lm_head" in config["quantization_config"]["ignore"]
    assert not (dest.parent / "w8a8.partial").exists()


def test_w4a16_on_widths_that_fit_passes_its_gate_and_is_published(w4a16_export):
    r, dest, src = w4a16_export
    m = published(r, dest, src, "w4a16")
    assert m["extra"]["size"] < 0.3 * m["extra"]["source_size"]  # 4-bit matrices; embeddings and lm_head stay fp32
    weights = json.loads((dest / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["num_bits"] == 4 and weights["weights"]["group_size"] == 128
    print(f"size {m['extra']['size']} of {m['extra']['source_size']}, loss delta {m['extra']['loss_delta']:+.2e}")


def test_vllm_cpu_refuses_the_w4a16_export_before_launch_where_it_has_no_kernel(w4a16_export, tmp_path):
    """vLLM's CPU build has its 4-bit kernel only in the AVX-512 libraries, for bf16/fp16: on a host without AVX-512
    the export is refused before any server starts (without the refusal the server starts, then its first completion
    kills the engine: docs/export.md). Where the host has AVX-512, the same folder is served at bf16 (that branch has
    not run yet: the machines baton is tested on have no AVX-512)."""
    from tasks.serve.config import ServeConfig, SmokeConfig
    from tasks.serve.engines import host_has_avx512
    from tasks.serve.quantized import check_quantized

    _, dest, _ = w4a16_export
    cfg = ServeConfig(engine="vllm", precision="bf16", health_timeout_s=300,
                      smoke=SmokeConfig(parity_prompts=2, parity_tokens=16))
    served = check_quantized(dest, cfg, tmp_path)
    if host_has_avx512():
        assert served.report["passed"], served.report
        return
    [refused] = served.report["checks"]
    assert refused["name"] == "preflight.vllm_cpu_quantization" and not refused["passed"]
    assert "quantization scheme W4A16" in refused["detail"] and "an AVX-512 CPU" in refused["detail"], refused
    assert "multiple of" not in refused["detail"] and "serve.precision" not in refused["detail"]
    assert not served.log.exists()


@pytest.mark.fast
def test_a_quantization_is_refused_before_anything_runs_without_data_or_with_groups_that_do_not_fit(
        tmp_path, hf_checkpoint, data_dir):
    """No --calibration: refused, naming the flag. w4a16 on the tiny model: its groups of 128 input columns do not
    divide intermediate_size 344 (llm-compressor would refuse it after calibrating): refused first, naming both."""
    r = cli("export", str(hf_checkpoint), str(tmp_path / "a"), "--type", "w8a8", home=tmp_path / "home")
    assert r.returncode == 2 and "--calibration DATA_DIR" in r.stderr, r.stderr
    r = cli("export", str(hf_checkpoint), str(tmp_path / "b"), "--type", "w4a16", "--calibration", str(data_dir),
            home=tmp_path / "home")
    assert r.returncode == 2 and "W4A16 quantizes weights in groups of 128" in r.stderr, r.stderr
    assert "intermediate_size 344" in r.stderr
    assert not any(tmp_path.glob("[ab]*"))


@pytest.mark.fast
def test_a_relay_whose_w4a16_groups_do_not_fit_is_refused_before_it_launches(hf_checkpoint):
    """In a run config: against the model section when the run trains it, against the input's config.json with
    --from; one message naming export.types and the widths (llm-compressor would refuse inside the export step,
    after every stage before it ran)."""
    from flows.config import ConfigError, load
    from flows.pipeline import prepare

    with pytest.raises(ConfigError, match=r"export\.types w4a16: W4A16 quantizes weights in groups of 128 input "
                                          r"columns, which do not divide this model's model\.ffn_hidden_size 344"):
        load(TINY, ["export.types=[w4a16]"])
    assert load(TINY, ["export.types=[w4a16]", "model.ffn_hidden_size=384"])
    cfg = load(TINY, ["export.types=[w8a8, w4a16]", "stages=[export]"])
    with pytest.raises(ConfigError, match=rf"--from {hf_checkpoint}: export\.types w4a16: .* intermediate_size 344"):
        prepare(cfg, str(hf_checkpoint))


@pytest.mark.fast
def test_vllm_cpu_refuses_the_schemes_it_has_no_kernel_for():
    from tasks.serve.config import ServeConfig
    from tasks.serve.engines import vllm_cpu_quantization_problem as problem

    def quantized(weights: dict, activations: dict | None, **model) -> dict:
        group = {"weights": {"type": "int", "symmetric": True, **weights}, "input_activations": activations}
        return {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
                **model, "quantization_config": {"quant_method": "compressed-tensors",
                                                 "config_groups": {"group_0": group}}}

    int8 = {"type": "int", "num_bits": 8, "dynamic": True}
    cpu, bf16 = ServeConfig(engine="vllm"), ServeConfig(engine="vllm", precision="bf16")
    assert problem(cpu, quantized({"num_bits": 8}, int8), avx512=False) is None
    assert problem(bf16, quantized({"num_bits": 4}, None), avx512=True) is None
    odd = problem(bf16, quantized({"num_bits": 4}, None, intermediate_size=344), avx512=True)
    assert "quantization scheme W4A16" in odd and "intermediate_size 344" in odd and "serve.device cuda" in odd
    assert "AVX-512" not in odd and "serve.precision" not in odd
    avx2 = problem(bf16, quantized({"num_bits": 4}, None), avx512=False)
    assert "quantization scheme W4A16" in avx2 and "an AVX-512 CPU" in avx2 and "multiple of" not in avx2
    fp32 = problem(cpu, quantized({"num_bits": 4}, None), avx512=True)
    assert "serve.precision bf16 or fp16, this is fp32 (float32)" in fp32 and "AVX-512" not in fp32
    assert problem(ServeConfig(engine="vllm", precision="auto"), quantized({"num_bits": 4}, None, dtype="bfloat16"),
                   avx512=True) is None
    fp8 = problem(cpu, quantized({"type": "float", "num_bits": 8}, {"type": "float", "num_bits": 8}))
    assert "quantization scheme FP8" in fp8 and "serve.device cuda" in fp8
    assert problem(ServeConfig(engine="vllm", device="cuda"), quantized({"num_bits": 4}, None, intermediate_size=344)) \
        is None
    assert problem(ServeConfig(engine="sglang"), quantized({"num_bits": 4}, None, intermediate_size=344)) is None
    assert problem(cpu, {"hidden_size": 128}) is None


@pytest.mark.fast
def test_the_cpu_kernel_rules_are_vllms_own():
    """The 4-bit rule baton refuses by is the one in the built vLLM runtime's CPUWNA16 kernel (read, not imported)."""
    from tasks.runtimes import runtime_dir
    from tasks.serve.engines import VLLM_CPU_WNA16_MULTIPLE

    found = sorted(runtime_dir("vllm").glob("lib/python*/site-packages/vllm/model_executor/kernels/linear/"
                                            "mixed_precision/cpu.py"))
    if not found:
        pytest.skip("the vllm runtime is not built (make runtimes)")
    source = found[0].read_text()
    assert "_CPUWNA16_SUPPORTED_QUANT_TYPES = (scalar_types.uint4, scalar_types.uint4b8)" in source
    assert source.count(f"partition_weight_shape[0] % {VLLM_CPU_WNA16_MULTIPLE} != 0") == 1
    assert source.count(f"partition_weight_shape[1] % {VLLM_CPU_WNA16_MULTIPLE} != 0") == 1
    assert "ops.cpu_gemm_wna16(" in source
    vllm = found[0].parents[4]
    platform = (vllm / "platforms" / "cpu.py").read_text()
    assert "if torch.cpu._is_avx512_supported():" in platform and "import vllm._C_AVX2" in platform
    op = b"cpu_gemm_wna16(Tensor input"  # the op's registered schema
    assert op not in (vllm / "_C_AVX2.abi3.so").read_bytes()
    avx512 = (vllm / "_C_AVX512.abi3.so").read_bytes()
    assert op in avx512
    built = set(re.findall(rb"cpu_gemm_wna16_impl<c10::(\w+),", avx512))
    assert built == {b"BFloat16", b"Half"}, built  # engines.VLLM_CPU_WNA16_DTYPES


def test_a_scheme_vllm_cpu_cannot_serve_is_refused_before_any_server_starts(w8a8_export, tmp_path):
    """The same folder, its config saying FP8: no server is launched (no log), the refusal names the scheme."""
    from tasks.serve.config import ServeConfig
    from tasks.serve.quantized import check_quantized

    _, dest = w8a8_export
    fp8 = tmp_path / "fp8"
    shutil.copytree(dest, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["type"] = group["input_activations"]["type"] = "float"
    (fp8 / "config.json").write_text(json.dumps(config))
    served = check_quantized(fp8, ServeConfig(engine="vllm"), tmp_path)
    [refused] = served.report["checks"]
    assert refused["name"] == "preflight.vllm_cpu_quantization" and not refused["passed"]
    assert "quantization scheme FP8" in refused["detail"] and not served.log.exists()


@pytest.mark.serve  # a vLLM server (~2 min with its start) on the export make test pays for anyway
@pytest.mark.timeout(600)
def test_vllm_serves_the_w8a8_export(w8a8_export, tmp_path):
    from tasks.serve.config import ServeConfig, SmokeConfig
    from tasks.serve.quantized import check_quantized

    _, dest = w8a8_export
    cfg = ServeConfig(engine="vllm", health_timeout_s=300, smoke=SmokeConfig(parity_prompts=2, parity_tokens=16))
    served = check_quantized(dest, cfg, tmp_path)
    checks = {c["name"]: c for c in served.report["checks"]}
    assert served.report["passed"], served.report
    assert set(checks) == {"smoke.models", "smoke.auth_401", "smoke.chat", "smoke.greedy"}
    assert "2 prompts x 16 tokens, the same twice" in checks["smoke.greedy"]["detail"]
    print(checks["smoke.greedy"]["detail"])


@pytest.mark.long  # a second quantization inside a relay run (~2-3 min on a loaded machine)
@pytest.mark.timeout(900)
def test_a_loss_bound_too_tight_fails_the_stage_and_registers_nothing(baton_home, hf_checkpoint):
    r = baton("run", str(TINY), "--from", str(hf_checkpoint), "--stages", "export",
              "--set", "export.types=[w8a8]", "--set", "export.max_loss_delta={w8a8: 1.0e-9}",
              "--set", f"export.calibration_rows={ROWS}",
              "--set", "data.pretrain_docs=200", "--set", "data.preference_pairs=40", "--set", "data.sft_examples=60",
              home=baton_home, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    stage = next(e for e in summary["stages"] if e["name"] == "export")
    assert (stage["status"], stage["failure"], stage["error"]) == ("failed", "gate",
                                                                   "gate failed: w8a8.quant.heldout_loss")
    assert abs(stage["metrics"]["w8a8_loss_delta"]) > 1e-9, stage["metrics"]
    assert not any(side.get("registered") for side in (stage.get("side_outputs") or {}).values())
    work = Path(stage["log"]).parent
    assert (work / "w8a8.partial" / "config.json").exists() and not (work / "w8a8").exists()
    client = mlflow_client(baton_home)
    assert not [m.name for m in client.search_registered_models() if "compressed-tensors" in m.name]
