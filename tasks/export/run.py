"""`baton export` outside a pipeline: llama.cpp's converter in the llamacpp runtime (worker.py), the gate
(conversions.gguf_export), and only then the folder published with its manifest (format gguf-file)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conversions import durable, gguf_export, manifest as mf, ollama
from conversions.manifest import Format
from tasks import events, runtimes
from tasks.export.config import moe_problem_of
from tasks.stage import REPO_ROOT

WORKER = Path(__file__).with_name("worker.py")
TIMEOUT_S = 3600
LOGIT_MEASURES = ("logit_rms", "argmax_agreement", "argmax_lead", "mean_kl")


@dataclass
class Outcome:
    report: dict                 # the gate's verify.report (empty checks when the converter failed)
    published: Path | None       # DEST when the gate passed
    kept: Path | None            # the unpublished output, to inspect, when it did not
    detail: str = ""


def refuse_source(src: Path) -> None:
    """The source must be an HF checkpoint (an export of anything else converts to HF first: `baton convert`) of a
    dense model (config.moe_problem)."""
    m = mf.read(src)
    if m is not None and m["format"] != Format.HF_SAFETENSORS:
        raise gguf_export.ExportError(f"{src}: a {m['format']} checkpoint; export reads {Format.HF_SAFETENSORS} "
                                      f"(`baton convert {src} HF_DEST` first)")
    if not (src / "config.json").exists():
        raise gguf_export.ExportError(f"{src}: no config.json; not a Hugging Face checkpoint")
    if problem := moe_problem_of(json.loads((src / "config.json").read_text()), str(src)):
        raise gguf_export.ExportError(problem)


def convert(src: Path, out: Path, type_name: str) -> tuple[events.ExportResult | None, str]:
    """Run the worker in the llamacpp runtime; its result, or None and the tail of its log."""
    python = runtimes.python_for("llamacpp")
    with tempfile.TemporaryDirectory(prefix="baton-export-") as scratch:
        spec = events.write_spec(Path(scratch) / "export_spec.json", worker_spec(src, out, type_name))
        proc = subprocess.run([python, str(WORKER), "--spec", str(spec)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1"))
    found = [e for line in proc.stdout.splitlines() if (e := events.parse(line)) and e["kind"] == "result"]
    if proc.returncode != 0 or len(found) != 1:
        return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}"
    return events.ExportResult.model_validate({k: v for k, v in found[0].items() if k != "kind"}), ""


def worker_spec(src: Path, out: Path, type_name: str) -> events.ExportSpec:
    """What the worker is asked for one type (the command's converter and the stage's launch both hand it this)."""
    quantize = gguf_export.export_type(type_name).quantize
    return events.ExportSpec(src=src, out=out, out_type="f16" if quantize else type_name, quantize=quantize)


def export(src: Path, dest: Path, type_name: str, max_logit_rms: float | None = None, converter=convert) -> Outcome:
    """Export src (an HF folder) to DEST/model.gguf; published with its manifest only when the gate passed.
    `converter`: how the worker is launched (the pipeline's stage streams its log through its StageContext)."""
    gguf_export.export_type(type_name)  # an unknown type is refused before anything runs
    refuse_source(src)
    partial = durable.partial_of(dest)
    shutil.rmtree(partial, ignore_errors=True)
    out = partial / gguf_export.GGUF_NAME
    result, why = converter(src, out, type_name)
    if result is None:
        shutil.rmtree(partial, ignore_errors=True)
        return Outcome({"passed": False, "checks": []}, None, None, f"the converter failed ({why})")
    rep = gguf_export.gate(out, src, type_name, max_logit_rms)
    if not rep["passed"]:
        return Outcome(rep, None, partial)
    modelfile = write_modelfile(src, partial)
    write_manifest(src, partial, type_name, result, rep, modelfile)
    durable.publish_dir(partial, dest)
    return Outcome(rep, dest, None)


def write_modelfile(src: Path, folder: Path) -> str:
    """Ollama's Modelfile beside the GGUF file when the chat template is of a known family (conversions.ollama): the
    family, or why there is none."""
    text, family = ollama.modelfile(src, gguf_export.GGUF_NAME)
    if text is not None:
        durable.write_text(folder / ollama.MODELFILE, text)
    return family


def write_manifest(src: Path, folder: Path, type_name: str, result: events.ExportResult, rep: dict,
                   modelfile: str) -> None:
    src_m = mf.read(src) or {}
    logits = next(c for c in rep["checks"] if c["name"] == "gguf.logits")
    m = mf.build(folder, format=Format.GGUF_FILE, stage="export", engine={"name": "llama.cpp",
                                                                          "converter": result.converter},
                 architecture=dict(src_m.get("architecture") or {}), parameter_count=src_m.get("parameter_count"),
                 dtype=type_name, parent=mf.parent_ref(src),
                 extra={"gguf_type": type_name, "seconds": result.seconds, "size": result.size,
                        "source": str(src.resolve()), "notes": result.notes, "modelfile": modelfile,
                        **{k: logits[k] for k in LOGIT_MEASURES}})
    mf.write(folder, m)
