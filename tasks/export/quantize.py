"""A quantized checkpoint for vLLM (`--type w8a8|w4a16`): llm-compressor in the llmcompressor runtime
(quantize_worker.py), calibrated on the run's own pretraining text, then the gate (conversions.vllm_quant) and only
then the folder published with its manifest (format hf-compressed-tensors)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from conversions import durable, manifest as mf, vllm_quant
from conversions.manifest import Format
from tasks import events, runtimes
from tasks.stage import REPO_ROOT

WORKER = Path(__file__).with_name("quantize_worker.py")
RUNTIME = "llmcompressor"
TIMEOUT_S = 3600
# the data stage's output: calibration rows from its pretraining train split, the loss on its held-out split
CALIBRATION_SPLIT, HELDOUT_SPLIT = Path("pretrain") / "train.jsonl", Path("pretrain") / "heldout.jsonl"
MEASURES = ("heldout_loss_source", "heldout_loss", "quantized_modules")


def data_files(data_dir: Path | None) -> tuple[Path, Path]:
    """The calibration and held-out files of a data stage's output; QuantError naming what is missing."""
    if data_dir is None:
        raise vllm_quant.QuantError("a quantized export calibrates on the run's own data, a data stage's output "
                                    "(.baton/runs/<run-id>/data): `baton export` takes it as --calibration DATA_DIR, "
                                    "the relay's export stage from its data stage")
    m = mf.read(data_dir)
    if m is None or m["format"] != Format.DATASET:
        raise vllm_quant.QuantError(f"--calibration {data_dir}: not a data stage's output (no {Format.DATASET} "
                                    "manifest)")
    files = (data_dir / CALIBRATION_SPLIT, data_dir / HELDOUT_SPLIT)
    for f in files:
        if not f.is_file():
            raise vllm_quant.QuantError(f"--calibration {data_dir}: {f.relative_to(data_dir)} missing")
    return files


def worker_spec(src: Path, out: Path, type_name: str, data_dir: Path | None, rows: int) -> events.QuantizeSpec:
    calibration, heldout = data_files(data_dir)
    return events.QuantizeSpec(src=src, out=out, scheme=vllm_quant.quant_type(type_name).preset,
                               calibration=calibration, calibration_rows=rows, heldout=heldout, heldout_rows=rows,
                               max_seq_length=vllm_quant.MAX_SEQ_LENGTH)


def quantize(spec: events.QuantizeSpec) -> tuple[events.QuantizeResult | None, str]:
    """Run the worker in the llmcompressor runtime; its result, or None and the tail of its log."""
    python = runtimes.python_for(RUNTIME)
    with tempfile.TemporaryDirectory(prefix="baton-quantize-") as scratch:
        path = events.write_spec(Path(scratch) / "quantize_spec.json", spec)
        proc = subprocess.run([python, str(WORKER), "--spec", str(path)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1"))
    found = [e for line in proc.stdout.splitlines() if (e := events.parse(line)) and e["kind"] == "result"]
    if proc.returncode != 0 or len(found) != 1:
        return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}"
    return events.QuantizeResult.model_validate({k: v for k, v in found[0].items() if k != "kind"}), ""


def export(src: Path, dest: Path, type_name: str, data_dir: Path | None, max_loss_delta: float | None = None,
           rows: int = vllm_quant.CALIBRATION_ROWS, quantizer=quantize):
    """Quantize src (an HF folder) into DEST; published with its manifest only when the gate passed.
    `quantizer`: how the worker is launched (the stage streams its log through its StageContext)."""
    from tasks.export.run import Outcome

    vllm_quant.refuse_shapes(type_name, json.loads((src / "config.json").read_text()))
    partial = durable.partial_of(dest)
    shutil.rmtree(partial, ignore_errors=True)
    spec = worker_spec(src, partial, type_name, data_dir, rows)
    result, why = quantizer(spec)
    if result is None:
        shutil.rmtree(partial, ignore_errors=True)
        return Outcome({"passed": False, "checks": []}, None, None, f"the quantizer failed ({why})")
    rep = vllm_quant.gate(partial, src, type_name, result.model_dump(), max_loss_delta)
    if not rep["passed"]:
        return Outcome(rep, None, partial)
    write_manifest(src, partial, type_name, spec, result, rep)
    durable.publish_dir(partial, dest)
    return Outcome(rep, dest, None)


def write_manifest(src: Path, folder: Path, type_name: str, spec: events.QuantizeSpec,
                   result: events.QuantizeResult, rep: dict) -> None:
    src_m = mf.read(src) or {}
    loss = next(c for c in rep["checks"] if c["name"] == "quant.heldout_loss")
    m = mf.build(folder, format=Format.COMPRESSED_TENSORS, stage="export",
                 engine={"name": "llm-compressor", "converter": result.quantizer},
                 architecture=dict(src_m.get("architecture") or {}), parameter_count=src_m.get("parameter_count"),
                 dtype=type_name, parent=mf.parent_ref(src),
                 extra={"quant_type": type_name, "scheme": spec.scheme, "seconds": result.seconds,
                        "size": result.size, "source_size": result.source_size, "source": str(src.resolve()),
                        "calibration": {"file": str(spec.calibration), "rows": spec.calibration_rows,
                                        "sha256": result.calibration_sha256},
                        "heldout": {"file": str(spec.heldout), "rows": spec.heldout_rows},
                        "heldout_loss_source": result.heldout_loss_source, "heldout_loss": result.heldout_loss,
                        "loss_delta": loss["loss_delta"], "max_loss_delta": loss["bound"]})
    mf.write(folder, m)
