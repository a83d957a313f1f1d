"""Verification ladder for checkpoints.

L0 integrity (manifest hashes and file set), L1 exact save/load round trip, L2 logits parity on probe inputs,
L3 deterministic greedy generation, and the serving preflight (what servers need and silently get wrong).
Each check is {"name", "passed", "detail"}; a report is {"passed", "checks"}.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from . import folder, hf, manifest as mf, probe
from .checks import check, report, timed
from .gguf_export import verify_export
from .manifest import Format


# ---- L0 ------------------------------------------------------------------------------------------------------------
def integrity(root: Path) -> list[dict]:
    root = Path(root)
    try:
        folder.refuse_unsafe(root)  # first: with or without a manifest, no reader may be led outside the folder
    except folder.UnsafeEntryError as e:
        return [check("L0.integrity", False, str(e))]
    m = mf.read(root)
    if m is None:
        return [check("L0.integrity", True, f"no {mf.MANIFEST_NAME}: integrity NOT checked "
                                            f"(write one with `baton manifest {root}`)")]
    expected = {f["path"]: f for f in m["files"]}
    present = {p.as_posix() for p in mf.list_files(root)}
    problems = []
    for path in sorted(set(expected) - present):
        problems.append(f"{path}: missing")
    for path in sorted(present - set(expected)):
        problems.append(f"{path}: not in the manifest")
    same_size = []
    for path in sorted(set(expected) & present):
        size = (root / path).stat().st_size
        if size != expected[path]["size"]:
            problems.append(f"{path}: size {size} != {expected[path]['size']}")
        else:
            same_size.append(path)
    for path, digest in zip(same_size, mf.sha256_files(root / p for p in same_size)):
        if digest != expected[path]["sha256"]:
            problems.append(f"{path}: sha256 mismatch (file changed or corrupted)")
    detail = "; ".join(problems) if problems else f"{len(expected)} files match the manifest ({m['format']})"
    return [check("L0.integrity", not problems, detail)]


# ---- finite weights ------------------------------------------------------------------------------------------------
def _nonfinite(tensors) -> tuple[int, list[str]]:
    import torch

    count, bad = 0, []
    for name, t in tensors:
        count += 1
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(f"{name} ({int((~torch.isfinite(t)).sum())} NaN/inf)")
    return count, bad


def _megatron_tensors(root: Path):
    from .megatron import DistReader

    reader = DistReader(root)
    for key in sorted(reader.metadata.state_dict_metadata):
        if reader.shape(key) is not None and not key.startswith("optimizer."):
            yield key, reader.read_full(key)


def finite_weights(root: Path) -> list[dict]:
    """Every weight tensor is finite (no NaN, no inf): what a diverged run writes and nothing else would catch
    (max(0.0, nan) is 0.0). One tensor in memory at a time."""
    root = Path(root)
    fmt = (mf.read(root) or {}).get("format")
    if fmt == Format.MEGATRON_DIST:
        tensors = _megatron_tensors(root)
    elif hf.safetensors_files(root):
        tensors = hf.iter_tensors(root)
    else:
        return [check("weights.finite", True, f"no weights of a known format in {root} ({fmt}); not checked")]
    count, bad = _nonfinite(tensors)
    if bad:
        return [check("weights.finite", False, f"{len(bad)} of {count} tensors are not finite: {', '.join(bad[:5])}")]
    return [check("weights.finite", True, f"all {count} tensors finite")]


# ---- serving preflight ---------------------------------------------------------------------------------------------
def _embedding_names(config) -> tuple[str | None, str | None]:
    """Names of the input and output embedding weights, found on the model itself (never hard-coded)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    in_name = out_name = None
    for name, module in model.named_modules(remove_duplicate=False):
        if module is inp and in_name is None:
            in_name = f"{name}.weight"
        if out is not None and module is out and out_name is None:
            out_name = f"{name}.weight"
    return in_name, out_name


def tied_embeddings(root: Path, config=None) -> dict:
    import torch
    from transformers import AutoConfig

    config = config or AutoConfig.from_pretrained(str(root))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    in_name, out_name = _embedding_names(config)
    shapes = hf.tensor_shapes(root)
    has_head = out_name in shapes
    if tied and not has_head:
        return check("preflight.tied_embeddings", True, f"tie_word_embeddings=true and no separate {out_name}")
    if not tied and not has_head:
        return check("preflight.tied_embeddings", False,
                     f"tie_word_embeddings=false but the weights have no {out_name}: servers would tie it silently")
    if tied:
        t = dict(hf.iter_tensors(root))
        same = in_name in t and t[in_name].shape == t[out_name].shape and torch.equal(t[in_name], t[out_name])
        if not same:
            return check("preflight.tied_embeddings", False,
                         f"tie_word_embeddings=true but {out_name} differs from {in_name}: "
                         "servers would discard the trained lm_head (gibberish, no error)")
        return check("preflight.tied_embeddings", True, f"tie_word_embeddings=true and {out_name} equals {in_name}")
    return check("preflight.tied_embeddings", True, f"untied: {out_name} present")


def transformers_classes(architectures: list[str]) -> list[str]:
    """The architectures transformers has a model class for."""
    import transformers

    return [a for a in architectures if isinstance(a, str) and hasattr(transformers, a)]


def preflight(root: Path) -> list[dict]:
    root = Path(root)
    checks = []
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        return [check("preflight.config", False, f"{cfg_path}: missing (not an HF checkpoint)")]
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        return [check("preflight.config", False, f"{cfg_path}: invalid JSON ({e})")]
    archs = raw.get("architectures") or []
    known = transformers_classes(archs)
    # which server can load it is the engines' own answer (tasks/serve/architectures.py), asked where one is chosen
    checks.append(check("preflight.architectures", bool(known),
                        f"config.json architectures={archs}" + ("" if known else
                        ": transformers has no such model class (baton loads, checks and trains HF checkpoints "
                        "with it)")))
    files = hf.safetensors_files(root)
    if not files:
        checks.append(check("preflight.safetensors", False, f"no *.safetensors in {root}"))
        return checks
    try:
        headers = {f.name: hf.read_header(f) for f in files}
    except ValueError as e:  # a header that cannot be read is no safetensors file to load
        checks.append(check("preflight.safetensors", False, str(e)))
        return checks
    bad = [name for name, header in headers.items() if (header.get("__metadata__") or {}).get("format") != "pt"]
    checks.append(check("preflight.safetensors_metadata", not bad,
                        f"{', '.join(bad)}: lacks metadata format=pt" if bad else f"{len(files)} file(s) with format=pt"))
    tok = mf.tokenizer_info(root)
    has_tok = "tokenizer.json" in tok["files"] or "tokenizer.model" in tok["files"]
    checks.append(check("preflight.tokenizer", has_tok,
                        f"tokenizer files: {tok['files']}" if has_tok else f"no tokenizer.json/tokenizer.model in {root}"))
    checks.append(check("preflight.chat_template", tok["chat_template"],
                        "chat template present" if tok["chat_template"] else
                        "no chat template (chat_template.jinja or tokenizer_config.json chat_template): "
                        "chat requests would fail"))
    if known:
        try:
            checks.append(tied_embeddings(root))
        except Exception as e:  # a config transformers cannot build is itself a failed check
            checks.append(check("preflight.tied_embeddings", False, f"could not build the model from config: {e}"))
    return checks


# ---- L1 ------------------------------------------------------------------------------------------------------------
def roundtrip(root: Path) -> list[dict]:
    """Load with transformers, save again, and compare every tensor with the files: exact equality."""
    import torch
    from transformers import AutoModelForCausalLM

    root = Path(root)
    model, info = AutoModelForCausalLM.from_pretrained(str(root), dtype="auto", output_loading_info=True)
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            problems.append(f"{key.replace('_', ' ')}: {sorted(map(str, info[key]))[:5]}")
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        saved = dict(hf.iter_tensors(Path(tmp)))
    original = dict(hf.iter_tensors(root))
    compared = 0
    for name, t in original.items():
        if name not in saved:
            if model.config.tie_word_embeddings and name.endswith("lm_head.weight"):
                continue
            problems.append(f"{name}: not written back")
            continue
        if t.dtype != saved[name].dtype or t.shape != saved[name].shape or not torch.equal(t, saved[name]):
            problems.append(f"{name}: differs after save/load")
        compared += 1
    detail = "; ".join(problems[:5]) if problems else f"{compared} tensors identical after load → save → load"
    return [check("L1.roundtrip", not problems, detail)]


# ---- L1 against the source -----------------------------------------------------------------------------------------
def source_parity(root: Path, src: Path) -> list[dict]:
    """The checks of an HF folder against the checkpoint it was converted from, where that format has a reader in
    the engine's own parameter names (DeepSpeed ZeRO), and for a Megatron mixture of experts (whose experts can be
    written in the wrong order or transposed without a shape telling); none for other sources."""
    fmt = _format_of(Path(src))
    if fmt == Format.DEEPSPEED_ZERO:
        return _guarded("L1.source_tensors", lambda: source_tensors(Path(root), Path(src)))
    if fmt == Format.MEGATRON_DIST and _megatron_moe(Path(src)):
        return _guarded("L1.source_tensors", lambda: megatron_source_tensors(Path(root), Path(src)))
    return []


def _megatron_moe(src: Path) -> bool:
    from . import megatron

    try:
        return megatron.moe(megatron.architecture(src)) is not None
    except megatron.MegatronCheckpointError:
        return False


def megatron_source_tensors(root: Path, src: Path) -> list[dict]:
    """An HF folder converted from a Megatron mixture of experts: every file tensor equals the box of the dist
    checkpoint it comes from (read again from the source, one layer's expert at a time), differences named."""
    from . import megatron

    plan = megatron.hf_plan(megatron.DistReader(src), megatron.architecture(src))
    want = {t.name: t.produce() for t in plan}
    problems = _differences(root, want) + [f"{n}: not in the source" for n in sorted(set(hf.tensor_shapes(root))
                                                                                     - set(want))]
    detail = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") \
        if problems else f"{len(want)} tensors equal the source's ({Path(src).name})"
    return [check("L1.source_tensors", not problems, detail)]


def source_tensors(root: Path, src: Path) -> list[dict]:
    """An HF folder converted from a DeepSpeed ZeRO checkpoint: transformers loads it (merging a mixture's experts by
    its own mapping, not baton's) into exactly the engine's parameters. A difference is named by the file tensors
    that hold it: a permuted expert order, a transposed expert, a dropped (shared) expert."""
    from . import zero

    source = {t.name: t for t in zero.planned_tensors(zero.open_checkpoint(src), lora=zero.adapter(src))}
    loaded, unexpected = _loaded_parameters(root)
    differ = [n for n, t in source.items() if loaded is None or n not in loaded or not _equal(t.produce(), loaded[n])]
    problems = _named_differences(root, {n: source[n] for n in differ}) + [f"{n}: not in the source"
                                                                          for n in unexpected]
    if differ and not problems:
        problems = [f"{n}: loads differently from the source" for n in differ]
    detail = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") \
        if problems else f"{len(source)} parameters load exactly as the source's ({Path(src).name})"
    return [check("L1.source_tensors", not problems, detail)]


def _loaded_parameters(root: Path):
    """(state dict, unexpected file tensors) as transformers loads the folder; (None, []) if it cannot."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(root), dtype="auto", output_loading_info=True)
    except Exception:  # the per-tensor comparison below names what is wrong
        return None, []
    return model.state_dict(), sorted(map(str, info.get("unexpected_keys") or []))


def _equal(want, got) -> bool:
    import torch

    return tuple(want.shape) == tuple(got.shape) and torch.equal(want.to(got.dtype), got)


def _named_differences(root: Path, params: dict) -> list[str]:
    """The file tensors save_pretrained would write for these source parameters, compared with the files."""
    import torch

    from . import hf_layout

    readers = {n: (torch.Size(t.shape), t.dtype, t.produce) for n, t in params.items()}
    want = {name: read() for name, (_, _, read) in hf_layout.file_layout(hf_layout.meta_model(root), readers).items()}
    return _differences(root, want)


def _differences(root: Path, want: dict) -> list[str]:
    """The files' tensors against `want` ({file tensor name: the source's tensor}), each difference named: missing,
    transposed, another shape, or holding another of the source's tensors (the wrong order)."""
    present = hf.tensor_shapes(root)
    problems = []
    with hf.TensorReader(root) as read:
        for name, w in want.items():
            if name not in present:
                problems.append(f"{name}: in the source, missing from the output")
                continue
            got = read(name)
            if _equal(w, got):
                continue
            if got.ndim == 2 and _equal(w.T, got):
                problems.append(f"{name}: transposed (shape {tuple(got.shape)}, the source's {tuple(w.shape)})")
            elif tuple(got.shape) != tuple(w.shape):
                problems.append(f"{name}: shape {tuple(got.shape)}, the source's {tuple(w.shape)}")
            else:
                holds = next((other for other, o in want.items() if other != name and _equal(o, got)), None)
                problems.append(f"{name}: differs from the source" + (f" (holds the source's {holds}: tensors in the "
                                                                      "wrong order)" if holds else ""))
    return problems


# ---- L2 ------------------------------------------------------------------------------------------------------------
def logits_parity(root: Path, against: Path) -> list[dict]:
    """Logits of root vs another HF checkpoint, or vs a probe_logits.safetensors reference from an engine."""
    from transformers import AutoConfig

    root, against = Path(root), Path(against)
    dtype = hf.dominant_dtype(root) or "float32"
    ref_file = against if against.suffix == ".safetensors" else against / probe.PROBE_FILE
    if ref_file.exists() and not (against / "config.json").exists():
        ids, ref = probe.load_reference(ref_file)
        label = f"engine reference {ref_file.name}"
    else:
        vocab = AutoConfig.from_pretrained(str(root)).vocab_size
        ids = probe.probe_input_ids(vocab)
        ref = probe.hf_logits(against, ids, dtype)
        label = str(against)
    got = probe.hf_logits(root, ids, dtype)
    res = probe.compare_logits(got, ref, dtype)
    return [check("L2.logits_parity", res["passed"], f"vs {label}: {res['detail']}")]


# ---- L3 ------------------------------------------------------------------------------------------------------------
SMOKE_MESSAGES = [{"role": "user", "content": "Classify the word: apple"}]


def generation_smoke(root: Path, max_new_tokens: int = 12) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root))
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype="auto").eval()
    if tok.chat_template:
        ids = tok.apply_chat_template(SMOKE_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok("Classify the word: apple", return_tensors="pt")["input_ids"]
    outs = []
    with torch.no_grad():
        for _ in range(2):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            outs.append(out[0, ids.shape[1]:].tolist())
    text = tok.decode(outs[0], skip_special_tokens=True)
    eos = tok.eos_token_id
    content = [t for t in outs[0] if t != eos]
    if outs[0] != outs[1]:
        return [check("L3.generation", False, "greedy generation is not deterministic")]
    if not content:
        return [check("L3.generation", False, "greedy generation produced no tokens before EOS")]
    return [check("L3.generation", True, f"{len(outs[0])} tokens, deterministic: {text[:60]!r}")]


# ---- everything ----------------------------------------------------------------------------------------------------
def _read_back(fmt: str, root: Path):
    """(name, tensor) for every weight of an engine checkpoint, read through its format's own reader."""
    if fmt == Format.MEGATRON_DIST:
        return _megatron_tensors(root)
    if fmt == Format.DEEPSPEED_ZERO:
        from conversions import zero

        return ((t.name, t.produce()) for t in zero.planned_tensors(zero.open_checkpoint(root)))
    raise ValueError(f"no reader for format {fmt!r}")


def engine_reload(root: Path, fmt: str) -> list[dict]:
    """An engine checkpoint (no HF weights to serve): every tensor reads back through its format's reader, with the
    shape its metadata promises and only finite values."""
    n, bad = _nonfinite(_read_back(fmt, root))
    if n == 0:
        return [check("L1.reload", False, f"no tensors could be read from the {fmt} checkpoint")]
    detail = f"{n} tensors read back" + (f"; not finite: {', '.join(bad[:5])}" if bad else ", all finite")
    return [check("L1.reload", not bad, detail)]


def _format_of(root: Path) -> str:
    m = mf.read(root)
    if m is not None:
        return m["format"]
    return Format.HF_SAFETENSORS if (root / "config.json").exists() else "unknown"


def verify(root: Path, against: Path | None = None, *, levels: tuple[str, ...] = ("L0", "preflight", "L1", "L2", "L3")) -> dict:
    """The checks that fit the checkpoint's format: L0 for every format; an HF checkpoint also gets the serving
    preflight, the save/load round trip, logits parity (with `against`) and generation; an engine checkpoint
    (Megatron dist, DeepSpeed ZeRO) gets an exact read-back instead. Later checks stop once the files are known bad.
    The report's `seconds` says what each level cost."""
    root = Path(root)
    checks: list[dict] = []
    seconds: dict[str, float] = {}

    def run(level, fn, guarded=True):  # guarded: an exception is that level's failed check
        return timed(seconds, level, (lambda: _guarded(level, fn)) if guarded else fn)

    if "L0" in levels:
        checks += run("L0", lambda: _integrity_or_refusal(root), guarded=False)
    if checks and not checks[-1]["passed"]:
        return report(checks, seconds)  # corrupted files: loading them would only add confusing errors
    fmt = _format_of(root)
    if fmt in (Format.MEGATRON_DIST, Format.DEEPSPEED_ZERO):
        return report(checks + (run("L1", lambda: engine_reload(root, fmt)) if "L1" in levels else []), seconds)
    if fmt in (Format.DATASET, Format.COMPRESSED_TENSORS):  # compressed-tensors: unreadable in this runtime
        return report(checks, seconds)
    if fmt == Format.GGUF_FILE:
        return report(checks + run("gguf", lambda: verify_export(root, against)), seconds)
    if "preflight" in levels:
        checks += run("preflight", lambda: preflight(root), guarded=False)
    if any(c["name"] in ("preflight.config", "preflight.safetensors") and not c["passed"] for c in checks):
        return report(checks, seconds)
    steps = [("L1", lambda: roundtrip(root)), ("L3", lambda: generation_smoke(root))]
    if against is not None:
        steps.insert(1, ("L2", lambda: logits_parity(root, against)))
    for level, fn in steps:
        if level in levels:
            checks += run(level, fn)
    return report(checks, seconds)


def _integrity_or_refusal(root: Path) -> list[dict]:
    try:
        return integrity(root)
    except mf.ManifestError as e:
        return [check("L0.integrity", False, str(e))]


def _guarded(level: str, fn) -> list[dict]:
    try:
        return fn()
    except Exception as e:
        return [check(f"{level}", False, f"{type(e).__name__}: {e}")]


def format_report(rep: dict) -> str:
    lines = []
    for c in rep["checks"]:
        lines.append(f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    if rep.get("seconds"):
        lines.append("  took " + ", ".join(f"{level} {s:.2f} s" for level, s in rep["seconds"].items()))
    lines.append("PASSED" if rep["passed"] else "FAILED")
    return "\n".join(lines)
