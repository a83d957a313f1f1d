"""GPU check (one prepared call on a lent GPU machine): Megatron-Core tokens/s and MFU, DeepSpeed ZeRO-2 / ZeRO-3 with
CPU optimizer offload, TRL DPO, and HF conversion with logits parity, written to one JSON.

    make gpu-wheels                       # here: the wheels the GPU image lacks, for Python 3.12, into .whl-gpu/
    make gpu-check                        # on the GPU machine: install .whl-gpu/, run the check (~1B model, bf16)
    make gpu-check DEVICE=cpu             # the same script on CPU with the tiny model (a test in `make test`)

Each stage runs through its own Prefect task body (`run_<stage>.fn`, as the pipeline calls it, without a flow around
it) with its pydantic config loaded from configs/tiny.yaml plus this profile's overrides, so the workers get exactly
the specs and commands the pipeline would give them. Results: `$OUT/gpu-check-<device>.json` (else
benchmarks/results/), rewritten after every part so a call cut short still reports what finished.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = REPO / "configs" / "tiny.yaml"
LOCK = REPO / "infra" / "runtimes" / "main.lock"
WHEEL_LIMIT = 64 << 20  # what one device call carries, the working tree included
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
# What the GPU image (Python 3.12, torch 2.11, transformers, peft, accelerate, pandas, pyarrow, ...) lacks: the three
# engines, datasets, and what our stage modules import (pydantic; Prefect for the @task decorator of each stage).
CARRY = [
    "megatron-core", "deepspeed", "hjson", "trl", "datasets", "dill", "multiprocess",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "prefect", "pydantic-settings", "pydantic-extra-types", "python-dotenv", "amplitude-analytics", "asgi-lifespan",
    "cachetools", "coolname", "exceptiongroup", "griffe", "griffelib", "griffecli", "h2", "hpack", "hyperframe",
    "jsonpatch", "jsonpointer", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions", "opentelemetry-proto",
    "opentelemetry-exporter-prometheus", "orjson", "pendulum", "python-slugify", "text-unidecode",
    "rfc3339-validator", "sniffio", "starlette", "toml", "tzdata", "websockets", "whenever", "importlib-metadata",
]

# ~1B Llama-shaped (Llama-3.2-1B's layers: hidden 2048, 16 layers, 32 heads, 8 KV groups, FFN 8192; 32k vocab, untied)
PROFILES = {
    "cuda": {
        "model": ["model.num_layers=16", "model.hidden_size=2048", "model.num_attention_heads=32",
                  "model.num_query_groups=8", "model.ffn_hidden_size=8192", "model.seq_length=2048"],
        # micro batch 8 (2 at first: 15% MFU with small GEMMs); step 12 profiled (profile_steps) for where time goes
        "pretrain": ["pretrain.steps=20", "pretrain.micro_batch_size=8", "pretrain.global_batch_size=32",
                     "pretrain.warmup_steps=2", "pretrain.checkpoint_every=20", "pretrain.eval_interval=20",
                     "pretrain.eval_iters=1", "pretrain.vocab_size=32000", "pretrain.lr=3.0e-4",
                     "pretrain.min_lr=3.0e-5", "pretrain.profile_steps=[12]"],
        "finetune": ["finetune.steps=4", "finetune.micro_batch_size=8", "finetune.lr=1.0e-5",
                     "finetune.max_seq_length=256"],
        "rlhf": ["rlhf.steps=4", "rlhf.micro_batch_size=8", "rlhf.lr=1.0e-6", "rlhf.max_seq_length=256"],
        "precision": "bf16",
    },
    "cpu": {
        "model": [],
        "pretrain": ["pretrain.steps=3", "pretrain.warmup_steps=1", "pretrain.checkpoint_every=3",
                     "pretrain.eval_interval=3", "pretrain.eval_iters=1", "pretrain.profile_steps=[2]"],
        "finetune": ["finetune.steps=2", "finetune.micro_batch_size=4"],
        "rlhf": ["rlhf.steps=2", "rlhf.micro_batch_size=4"],
        "precision": "fp32",
    },
}
COMMON = ["data.pretrain_docs=600", "data.preference_pairs=60", "data.sft_examples=60",
          "finetune.nproc_per_node=1", "finetune.warmup_steps=1", "finetune.checkpoint_every=100",
          "rlhf.backend=trl"]
ZERO_RUNS = {"zero2": ["finetune.zero.stage=2"],
             "zero3_offload": ["finetune.zero.stage=3", "finetune.zero.offload_optimizer=cpu"]}
SDIST_ONLY = {"deepspeed"}  # PyPI has no wheel of it: built here with DS_BUILD_OPS=0 (ops JIT-compile on use)
PARTS = ("pretrain", "zero2", "zero3_offload", "dpo")


# ---- wheels: downloaded here, installed there ----------------------------------------------------------------------
def locked_versions() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split()[0].split("==")
            out[name.lower().replace("_", "-")] = version
    return out


def download_wheels(dest: Path) -> dict:
    """Each CARRY package at the main runtime's locked version, as a cp312 manylinux wheel, without dependencies."""
    versions = locked_versions()
    dest.mkdir(parents=True, exist_ok=True)
    missing = [n for n in CARRY if n not in versions]
    if missing:
        raise SystemExit(f"{LOCK}: no locked version for {', '.join(missing)}")
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    pins = [f"{n}=={versions[n]}" for n in CARRY if n not in SDIST_ONLY]
    env = dict(os.environ, PIP_CONSTRAINT="", DS_BUILD_OPS="0")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest), *pins],
                   check=True, env=env)
    # built here with this runtime's torch; without prebuilt ops the wheel is pure Python (py3-none-any)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
                    *(f"{n}=={versions[n]}" for n in SDIST_ONLY)], check=True, env=env)
    impure = [w.name for w in dest.glob("*.whl") if w.name.split("-")[0].replace("_", "-") in SDIST_ONLY
              and not w.name.endswith("-py3-none-any.whl")]
    if impure:
        raise SystemExit(f"{dest}: {impure} built with compiled parts; they would not load on Python 3.12")
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    report = {"wheels": len(wheels), "total_mib": round(total / 2**20, 2), "limit_mib": WHEEL_LIMIT >> 20,
              "largest": sorted(((w.name, round(w.stat().st_size / 2**20, 2)) for w in wheels),
                                key=lambda x: -x[1])[:5]}
    print(json.dumps(report, indent=2))
    if total > WHEEL_LIMIT:
        raise SystemExit(f"{dest}: {total / 2**20:.1f} MiB of wheels exceeds the {WHEEL_LIMIT >> 20} MiB a call carries")
    return report


def install_wheels(src: Path, target: Path) -> None:
    """pip --target (no index, no deps), then make the target importable here and in every worker we launch."""
    wheels = sorted(src.glob("*.whl"))
    if not wheels:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "megatron-core", "deepspeed", "trl", "datasets",
                 "pydantic", "prefect", "transformer-engine"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def unmet_requirements() -> list[str]:
    """The carried packages' requirements that the machine's own versions do not meet (installed with --no-deps, so
    a mismatch would otherwise surface only as an import error deep inside a worker)."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    problems = []
    for name in ("megatron-core", "deepspeed", "trl", "datasets", "prefect", "pydantic"):
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = version(req.name)
            except PackageNotFoundError:
                problems.append(f"{name} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: have {have}")
    return problems


# ---- the parts -----------------------------------------------------------------------------------------------------
def overrides(profile: str, device: str, extra: list[str] = ()) -> list[str]:
    prof = PROFILES[profile]
    return [*COMMON, *prof["model"], *prof["pretrain"], *prof["finetune"], *prof["rlhf"], *extra,
            *(f"{s}.precision={prof['precision']}" for s in ("pretrain", "finetune", "rlhf")),
            *(f"{s}.device={device}" for s in ("pretrain", "finetune", "rlhf"))]


def load_config(device: str, extra: list[str] = ()):
    """configs/tiny.yaml + this device's profile, validated by the pipeline's own config model."""
    from flows.config import load

    return load(TINY, overrides(device, device, extra), stages=["data", "pretrain", "rlhf", "finetune"])


def context(stage: str, work: Path, cfg, **kw):
    from tasks.stage import StageContext

    d = work / stage
    d.mkdir(parents=True, exist_ok=True)
    return StageContext(stage=stage, run_id="gpu-check", run_dir=work, work_dir=d, model=cfg.model.model_dump(),
                        seed=cfg.seed, **kw)


def make_data(work: Path, cfg) -> Path:
    from conversions import manifest as mf
    from tasks.data.task import write_data

    ctx = context("data", work, cfg)
    write_data(ctx, cfg.data)
    mf.write(ctx.work_dir, mf.build(ctx.work_dir, format="dataset", stage="data",
                                    tokenizer_dir=ctx.work_dir / "tokenizer"))
    return ctx.work_dir


def gate_summary(gate: dict) -> dict:
    return {"passed": gate["passed"], "failed": [f"{c['name']}: {c.get('detail', '')}" for c in gate["checks"]
                                                 if not c["passed"]]}


def convert(work: Path, cfg, name: str, src: Path, from_format: str, device: str) -> dict:
    """The pipeline's convert step (converter + its gate, L2 against the engine's probe logits), then the same
    parity measured on `device` with the output's own dtype."""
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert

    ctx = context(f"convert-{name}", work, cfg, input=src, input_format=from_format,
                  extra={"from_format": from_format, "to_format": "hf-safetensors"})
    t0 = time.time()
    out = run_convert.fn(ctx, ConvertConfig())
    return {"output": str(out.output), "seconds": round(time.time() - t0, 2), "convert_seconds": out.metrics["wall_s"],
            "gate": gate_summary(out.gate), "parity_on_device": parity(out.output, src, device)}


def parity(hf_dir: Path, engine_dir: Path, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from conversions import hf, probe

    ref = engine_dir / probe.PROBE_FILE
    if not ref.exists():
        return {"passed": False, "detail": f"{ref}: missing"}
    ids, ref_logits = probe.load_reference(ref)
    dtype = hf.dominant_dtype(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits.float().cpu()
    del model
    return {k: v for k, v in probe.compare_logits(logits, ref_logits, dtype).items()} | {"dtype": dtype}


def run_pretrain(work: Path, cfg, data: Path) -> dict:
    from tasks.pretrain.task import run_pretrain as stage

    t0 = time.time()
    ctx = context("pretrain", work, cfg, data_dir=data)
    out = stage.fn(ctx, cfg.pretrain)
    m = out.metrics
    profiles = [p.name for p in sorted(ctx.work_dir.glob("profile-step*-rank0.txt"))]
    for name in profiles:  # beside the JSON: the operator table of the profiled step
        shutil.copy2(ctx.work_dir / name, out_dir() / f"gpu-check-{cfg.pretrain.resolved_device()}-{name}")
    return {"output": str(out.output), "seconds": round(time.time() - t0, 2), "backend": out.backend,
            "layer_spec": out.extra.get("layer_spec"), "precision": cfg.pretrain.precision,
            "micro_batch_size": cfg.pretrain.micro_batch_size, "global_batch_size": cfg.pretrain.global_batch_size,
            "profiles": profiles,
            "tokens_per_s": m["tokens_per_s"], "mfu": m["mfu"], "peak_tflops_per_rank": m["peak_tflops_per_rank"],
            "peak_tflops_source": out.extra.get("peak_tflops_source"), "train_seconds": m["train_time_s"],
            "loss_first": m["loss_first"], "loss_last": m["loss_last"],
            "peak_gpu_allocated_mib": m.get("peak_gpu_allocated_mib"), "gate": gate_summary(out.gate)}


def run_zero(work: Path, device: str, name: str, data: Path, hf_in: Path) -> dict:
    from tasks.finetune.task import run_finetune

    cfg = load_config(device, ZERO_RUNS[name])
    t0 = time.time()
    out = run_finetune.fn(context(name, work, cfg, data_dir=data, input=hf_in, input_format="hf-safetensors"),
                          cfg.finetune)
    m = out.metrics
    return {"output": str(out.output), "seconds": round(time.time() - t0, 2), "backend": out.backend,
            "zero": out.extra["zero"], "step_time_s": m["last_step_time_s"], "tokens_per_s": m["last_tokens_per_s"],
            "peak_allocated_mb": m["peak_mem_mib"], "peak_reserved_mb": m.get("peak_reserved_mib"),
            "loss_first": m["loss_first"], "loss_last": m["loss_last"],
            "gate_note": "held-out exact match must improve; a few steps rarely do", "gate": gate_summary(out.gate)}


def run_dpo(work: Path, cfg, data: Path, hf_in: Path, device: str) -> dict:
    from tasks.rlhf.task import run_rlhf

    t0 = time.time()
    out = run_rlhf.fn(context("rlhf", work, cfg, data_dir=data, input=hf_in, input_format="hf-safetensors"), cfg.rlhf)
    return {"output": str(out.output), "seconds": round(time.time() - t0, 2), "metrics": out.metrics,
            "eval": out.eval, "gate": gate_summary(out.gate),
            "parity_on_device_vs_cpu_gate": "the gate's L1 round trip and L3 generation run on CPU"}


# ---- driver ----------------------------------------------------------------------------------------------------------
OUT_DIR: Path | None = None  # where the JSON (and the pretrain profile) go; set by main()


def out_dir() -> Path:
    return OUT_DIR or REPO / "benchmarks" / "results"


def gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())


def write(result: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def part(result: dict, path: Path, name: str, fn, *args):
    """Run one part; a failure is recorded (with its message) and the check goes on with the next part."""
    t0 = time.time()
    try:
        result[name] = fn(*args)
    except Exception as e:  # noqa: BLE001 - one part failing must not hide the others' numbers
        result[name] = {"error": f"{type(e).__name__}: {e}"[-4000:], "seconds": round(time.time() - t0, 2)}
    write(result, path)
    print(f"[gpu-check] {name}: {json.dumps(result[name], default=str)[:600]}", flush=True)
    return result[name]


def run_check(device: str, out_path: Path, work: Path, parts: tuple[str, ...]) -> dict:
    cfg = load_config(device, [])
    result: dict = {"device": device, "gpu": gpu_name(device), "versions": versions(),
                    "unmet_requirements": unmet_requirements(), "peak_bf16_tflops_reference": 989.0,
                    "mfu_anchor": "Megatron-Core 47% MFU on H100", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}
    write(result, out_path)
    t0 = time.time()
    data = make_data(work, cfg)
    pre = part(result, out_path, "pretrain", run_pretrain, work, cfg, data)
    result.update(mfu=pre.get("mfu"), tokens_per_s=pre.get("tokens_per_s"))
    if "error" in pre:
        return result
    conv = part(result, out_path, "convert_pretrain", convert, work, cfg, "pretrain", Path(pre["output"]),
                "megatron-dist", device)
    hf_in = Path(conv["output"]) if "output" in conv else None
    shutil.rmtree(Path(pre["output"]).parent / "checkpoints", ignore_errors=True)  # ~17 GB at 1B in bf16: the disk
    shutil.rmtree(pre["output"], ignore_errors=True)  # is needed for the ZeRO checkpoints next
    for name in ("zero2", "zero3_offload"):
        if name in parts and hf_in is not None:
            z = part(result, out_path, name, run_zero, work, device, name, data, hf_in)
            if "output" in z:
                part(result, out_path, f"convert_{name}", convert, work, cfg, name, Path(z["output"]),
                     "deepspeed-zero", device)
                shutil.rmtree(z["output"], ignore_errors=True)  # tens of GB at 1B: free the disk for the next part
    if "dpo" in parts and hf_in is not None:
        part(result, out_path, "dpo", run_dpo, work, cfg, data, hf_in, device)
    result["seconds"] = round(time.time() - t0, 1)
    result["passed"] = passed(result)
    write(result, out_path)
    return result


def passed(result: dict) -> bool:
    """Every part ran; every conversion's gate and on-device parity passed."""
    for name, value in result.items():
        if isinstance(value, dict) and "error" in value:
            return False
        if name.startswith("convert_") and not (value["gate"]["passed"] and value["parity_on_device"]["passed"]):
            return False
    return "pretrain" in result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--download-wheels", type=Path, help="only download the carried wheels into this folder")
    ap.add_argument("--wheels", type=Path, default=None, help="install the wheels in this folder first")
    ap.add_argument("--out", type=Path, default=None, help="result folder (default: $OUT, else benchmarks/results)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (pretrain always)")
    args = ap.parse_args(argv)
    if args.download_wheels:
        download_wheels(args.download_wheels)
        return 0
    if args.wheels is not None:
        install_wheels(args.wheels, Path(tempfile.gettempdir()) / "baton-gpu-site")
    global OUT_DIR
    OUT_DIR = args.out or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out_path = OUT_DIR / f"gpu-check-{args.device}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix="baton-gpu-check-"))
    try:
        result = run_check(args.device, out_path, work, tuple(args.parts.split(",")))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu-check] {'PASSED' if result.get('passed') else 'FAILED'}: {out_path}", flush=True)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
