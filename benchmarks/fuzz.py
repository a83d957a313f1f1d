"""Fuzz baton's checkpoint readers with mutated real checkpoints, under a memory limit, with a canary for executed code.

    .venv/bin/python benchmarks/fuzz.py --cases 10000 --seed 1 --out WORK_DIR [--workers 2] [--result RESULT.json]

Seeds are written here with the real libraries: a torch.save file of a ZeRO-like state dict (model tensors and an
optimizer-like nested dict), a Megatron torch_dist folder (torch.distributed.checkpoint `.metadata` + `.distcp`,
`common.pt`, `metadata.json`), a safetensors file, a baton manifest and a sealed folder (HMAC under a key of its own).
Each case copies one seed, mutates one of its files (byte flips, inserts, deletes, truncation; large length fields in
zip, safetensors, pickle and JSON; pickle splices of code-running opcodes into a zip's data.pkl or `.metadata`), runs
baton's reader of that format and reads every tensor it returns. Payloads that would run try to create CANARY; an
audit hook in the worker also counts os.system, subprocess, exec/compile of source text and any open of CANARY.

Cases run in long-lived worker processes (RLIMIT_AS, a per-case timeout: a hang kills and restarts the worker, so does
a death by signal). Outcomes: refused (baton's own Refused, a check's verdict, or a library parse error listed in
DOCUMENTED_PARSE_ERRORS by type and raising module), loaded, accepted (a sealed or manifested file whose bytes changed
was read without a word), or unexpected (any other exception, named with where it was raised: a finding). Every run also
passes its code-running payloads through plain pickle.loads in the same workers (the control): each must trip the
canary, or "0 executed" would mean nothing. Exit status 1 on an executed payload, an accepted change, an unexpected
exception, a worker killed or exited, a hang, or a control that did not trip (`failures`, which tests/test_fuzz.py
asserts too). --reader PATH:FUNCTION runs a planted reader instead of baton's (tests/fuzz_planted.py).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import queue
import random
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "fuzz.json"
MEMORY_LIMIT = 3 << 30
CASE_TIMEOUT_S = 10.0
FORMAT_WEIGHTS = {"zero": 3, "megatron": 4, "safetensors": 2, "manifest": 1, "seal": 1}
SEAL_MARKER = "baton_complete.json"
CANARY = "CANARY"


# ---- seeds ----------------------------------------------------------------------------------------------------------
def build_seeds(root: Path) -> Path:
    """One folder per format, written by the real libraries (run once, in the parent)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from conversions import manifest as mf, megatron, sealed

    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.ones(8, dtype=torch.bfloat16),
               "fc.weight": torch.randn(8, 8, generator=g).t(), "fc.bias": torch.arange(8, dtype=torch.int64)}

    zero = root / "zero"
    zero.mkdir()
    torch.save({"module": weights, "optimizer": {"state": {0: {"step": 3, "exp_avg": torch.zeros(16, 8),
                                                               "exp_avg_sq": torch.full((16, 8), 0.5)}},
                                                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
                "global_steps": 3, "ds_version": "0.16.0"}, zero / "mp_rank_00_model_states.pt")

    meg = root / "megatron"
    meg.mkdir()
    state = {megatron.EMBEDDING: torch.randn(32, 8, generator=g), megatron.FINAL_NORM: torch.ones(8),
             megatron.LAYER["qkv"]: torch.randn(2, 24, 8, generator=g)}
    with warnings.catch_warnings():  # "no process group: assuming a single process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(meg)), no_dist=True)
    torch.save({"checkpoint_version": 3.0, megatron.ARCH_KEY: {"num_layers": 2, "hidden_size": 8}},
               meg / megatron.COMMON_FILE)
    (meg / megatron.METADATA_FILE).write_text(json.dumps(megatron.TORCH_DIST_METADATA))

    st = root / "safetensors"
    st.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(st / "model.safetensors"),
              metadata={"format": "pt"})

    man = root / "manifest"
    man.mkdir()
    (man / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    mf.write(man, mf.build(man, format="hf-safetensors", stage="convert", parameter_count=200, dtype="float32"))

    seal = root / "seal"
    (seal / "global_step3").mkdir(parents=True)
    (seal / "global_step3" / "weights.bin").write_bytes(os.urandom(256))
    (seal / "latest").write_text("global_step3")
    before = os.environ.get(sealed.KEY_ENV)
    os.environ[sealed.KEY_ENV] = str(root / "seal.key")  # a key of the fuzz run's own, never the BATON_HOME's
    try:
        sealed.seal(seal, SEAL_MARKER, step=3, engine="deepspeed")
    finally:
        os.environ.pop(sealed.KEY_ENV) if before is None else os.environ.__setitem__(sealed.KEY_ENV, before)
    return root


# ---- mutations ------------------------------------------------------------------------------------------------------
def _s(text: str) -> bytes:  # BINUNICODE
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"


def _call(func: bytes, *args: bytes) -> bytes:  # func(*args) through REDUCE
    return func + b"(" + b"".join(args) + b"tR"


def payloads(canary: str) -> dict[str, bytes]:
    """Pickle fragments that each push one object; the code-running ones create `canary` when they run."""
    touch = _s(f"touch {canary}")
    opener = f"open({canary!r}, 'w').close()"
    return {
        "GLOBAL os.system": _call(_global("os", "system"), touch),
        "GLOBAL builtins.exec": _call(_global("builtins", "exec"), _s(opener)),
        "GLOBAL builtins.eval": _call(_global("builtins", "eval"), _s(f"__import__('os').system('touch {canary}')")),
        "STACK_GLOBAL posixpath.os.system": _call(_stack_global("posixpath", "os.system"), touch),
        "STACK_GLOBAL torch.serialization.os.system": _call(_stack_global("torch.serialization", "os.system"), touch),
        "STACK_GLOBAL collections.OrderedDict.__init__.__globals__":
            _stack_global("collections", "OrderedDict.__init__.__globals__"),
        "REDUCE getattr(__import__('os'), 'system')": _call(
            _call(_global("builtins", "getattr"), _call(_global("builtins", "__import__"), _s("os")), _s("system")),
            touch),
        "REDUCE subprocess.call": _call(_global("subprocess", "call"), b"]" + b"(" + _s("touch") + _s(canary) + b"e"),
        "INST os.system": b"(" + touch + b"ios\nsystem\n",
        "OBJ os.system": b"(" + _global("os", "system") + touch + b"o",
        "NEWOBJ_EX subprocess.Popen": _global("subprocess", "Popen") + b"(]" + b"(" + _s("touch") + _s(canary)
                                      + b"et}\x92",
        "NEWOBJ collections.OrderedDict": _global("collections", "OrderedDict") + b")\x81",
        "BUILD __dict__ on torch.Size": _call(_global("torch", "Size"), b")") + b"}" + _s("x") + _s("y") + b"s" + b"b",
        "memo bomb LONG_BINPUT 2^32-1": b"N" + b"r" + struct.pack("<I", 0xFFFFFFFF),
        "memo bomb LONG_BINGET 2^31": b"N0" + b"j" + struct.pack("<I", 1 << 31),
        "bytearray bomb REDUCE bytearray(2^31)": _call(_global("builtins", "bytearray"),
                                                       b"J" + struct.pack("<i", 0x7FFFFFFF)),
        "bytearray bomb BYTEARRAY8 2^40": b"\x96" + struct.pack("<Q", 1 << 40),
        "EXT1 copyreg extension": b"\x82\x01",
        "REDUCE torch.load": _call(_global("torch", "load"), _s("/etc/passwd")),
    }


CODE_RUNNING = ("GLOBAL os.system", "GLOBAL builtins.exec", "GLOBAL builtins.eval", "STACK_GLOBAL posixpath.os.system",
                "REDUCE getattr(__import__('os'), 'system')", "REDUCE subprocess.call", "INST os.system",
                "OBJ os.system")


def _opcode_starts(data: bytes) -> list[int]:
    import pickletools

    try:
        return [pos for _, _, pos in pickletools.genops(data)]
    except Exception:
        return [2]


def splice_pickle(data: bytes, rng: random.Random, canary: str) -> tuple[bytes, str]:
    name, payload = rng.choice(sorted(payloads(canary).items()))
    mode = rng.choice(["after PROTO", "at an opcode", "whole pickle", "before STOP, result kept"])
    if mode == "whole pickle":
        return b"\x80\x04" + payload + b".", f"pickle splice {name} ({mode})"
    if mode == "before STOP, result kept":  # the payload's object replaces the pickle's result
        return data[:-1] + b"0" + payload + b".", f"pickle splice {name} ({mode})"
    if mode == "after PROTO" and data[:1] == b"\x80":  # protocol 4: STACK_GLOBAL then resolves dotted names
        data = b"\x80\x04" + data[2:]
    at = 2 if mode == "after PROTO" else rng.choice(_opcode_starts(data)[1:] or [2])
    return data[:at] + payload + b"0" + data[at:], f"pickle splice {name} ({mode} @{at})"


_LENGTH_OPS = {"BININT": ("<i", [0x7FFFFFFF, -1, -(1 << 31), 1 << 30]), "BININT2": ("<H", [0xFFFF]),
               "BININT1": ("<B", [0xFF]), "BINUNICODE": ("<I", [0xFFFFFFFF, 1 << 31]),
               "BINBYTES": ("<I", [0xFFFFFFFF, 1 << 31]), "LONG_BINPUT": ("<I", [0xFFFFFFFF]),
               "LONG_BINGET": ("<I", [0xFFFFFFFF]), "BINUNICODE8": ("<Q", [1 << 62]), "FRAME": ("<Q", [1 << 62])}


def pickle_length(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One opcode's integer or length argument set to an extreme (sizes, strides, numel, offsets, string lengths)."""
    import pickletools

    try:
        ops = [(op.name, pos) for op, _, pos in pickletools.genops(data) if op.name in _LENGTH_OPS]
    except Exception:
        ops = []
    if not ops:
        return bytes_mutation(data, rng)
    name, pos = rng.choice(ops)
    fmt, values = _LENGTH_OPS[name]
    value = rng.choice(values)
    field = struct.pack(fmt, value)
    return data[:pos + 1] + field + data[pos + 1 + len(field):], f"pickle {name} @{pos} = {value}"


_ZIP_FIELDS = {b"PK\x03\x04": [(18, 4), (22, 4), (26, 2), (28, 2)],           # local header: sizes, name/extra length
               b"PK\x01\x02": [(20, 4), (24, 4), (28, 2), (30, 2), (42, 4)],  # central dir: sizes, lengths, offset
               b"PK\x05\x06": [(8, 2), (10, 2), (12, 4), (16, 4)],            # end of central dir: counts, size, offset
               b"PK\x06\x06": [(24, 8), (32, 8), (40, 8), (48, 8)]}           # zip64 end of central dir


def zip_length(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    spots = [(m.start(), sig) for sig in _ZIP_FIELDS for m in re.finditer(re.escape(sig), data)]
    if not spots:
        return bytes_mutation(data, rng)
    at, sig = rng.choice(spots)
    off, width = rng.choice(_ZIP_FIELDS[sig])
    big = (1 << (8 * width)) - 1
    value = rng.choice([big, big >> 1, (big >> 1) + 1, len(data), len(data) + 1])
    value &= big
    field = value.to_bytes(width, "little")
    return data[:at + off] + field + data[at + off + width:], f"zip {sig!r} @{at}+{off} = {value}"


def safetensors_length(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.4:
        value = rng.choice([(1 << 64) - 1, 1 << 63, 100_000_001, len(data) - 7, len(data), 0])
        return struct.pack("<Q", value) + data[8:], f"safetensors header length = {value}"
    (n,) = struct.unpack("<Q", data[:8])
    header, rest = data[8:8 + n].decode(), data[8 + n:]
    new, what = json_length(header, rng)
    body = new.encode()
    return struct.pack("<Q", len(body)) + body + rest, f"safetensors header: {what}"


def json_length(text: str, rng: random.Random) -> tuple[str, str]:
    numbers = list(re.finditer(r"-?\d+(\.\d+)?", text))
    kind = rng.choice(["number", "number", "deep nesting", "long string"])
    if kind == "number" and numbers:
        m = rng.choice(numbers)
        value = rng.choice(["18446744073709551615", "-1", "1e999", "9" * 26, "-9223372036854775809"])
        return text[:m.start()] + value + text[m.end():], f"JSON number @{m.start()} = {value}"
    if kind == "deep nesting":
        depth = rng.choice([1000, 100_000])
        return "[" * depth + text + "]" * depth, f"JSON nested {depth} deep"
    at = rng.randrange(len(text) + 1)
    return text[:at] + '"' + "A" * (1 << 20) + '"' + text[at:], f"JSON 1 MiB string @{at}"


def bytes_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["flip", "flip", "insert", "delete", "truncate", "duplicate"])
    n = len(data)
    if n == 0:
        return os.urandom(rng.randrange(1, 64)), "random bytes into an empty file"
    if kind == "flip":
        b = bytearray(data)
        spots = [rng.randrange(n) for _ in range(rng.choice([1, 1, 2, 8, 64]))]
        for at in spots:
            b[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
        return bytes(b), f"flip {len(spots)} byte(s) from @{min(spots)}"
    at = rng.randrange(n)
    if kind == "insert":
        junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 64, 4096])))
        return data[:at] + junk + data[at:], f"insert {len(junk)} bytes @{at}"
    if kind == "delete":
        k = rng.choice([1, 4, 64, 4096])
        return data[:at] + data[at + k:], f"delete {k} bytes @{at}"
    if kind == "truncate":
        return data[:at], f"truncate to {at} bytes"
    k = rng.choice([16, 256, 4096])
    return data[:at] + data[at:at + k] + data[at:], f"duplicate {k} bytes @{at}"


def rewrite_zip(data: bytes, mutate) -> tuple[bytes, str]:
    """The zip with its data.pkl member replaced by mutate(data.pkl), every other member as it was (stored)."""
    import io

    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    what = ""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            member = src.read(info)
            if info.filename.endswith("/data.pkl"):
                member, what = mutate(member)
            dst.writestr(info.filename, member)
    return out.getvalue(), f"data.pkl: {what}"


# which files of each seed a case may mutate, with how often
TARGETS = {"zero": [("mp_rank_00_model_states.pt", 1)],
           "megatron": [(".metadata", 4), ("__0_0.distcp", 3), ("common.pt", 2), ("metadata.json", 1)],
           "safetensors": [("model.safetensors", 1)],
           "manifest": [("baton_manifest.json", 2), ("config.json", 1)],
           "seal": [(SEAL_MARKER, 4), ("global_step3/weights.bin", 1)]}


def mutate(folder: Path, fmt: str, rng: random.Random, canary: str) -> tuple[str, bool]:
    """Mutate one file of the seed copy at folder; what was done, in words, and whether its bytes changed."""
    names, weights = zip(*TARGETS[fmt])
    name = rng.choices(names, weights)[0]
    path = folder / name
    data = path.read_bytes()
    is_zip, is_pickle = name.endswith(".pt"), name == ".metadata"
    r = rng.random()
    if (is_zip or is_pickle) and r < 0.45:
        splice = lambda d: splice_pickle(d, rng, canary) if rng.random() < 0.75 else pickle_length(d, rng)  # noqa: E731
        data, what = rewrite_zip(data, splice) if is_zip else splice(data)
    elif r < 0.7 and name.endswith(".json"):
        text, what = json_length(data.decode(), rng)
        data = text.encode()
    elif r < 0.7 and name.endswith(".safetensors"):
        data, what = safetensors_length(data, rng)
    elif r < 0.7 and name.endswith((".pt", ".distcp")):
        data, what = zip_length(data, rng)
    else:
        data, what = bytes_mutation(data, rng)
    changed = data != path.read_bytes()
    path.write_bytes(data)
    return f"{name}: {what}", changed


# ---- the worker -----------------------------------------------------------------------------------------------------
class Canary:
    """An audit hook that records, while armed, what only executed code would do; plus the canary file itself."""

    PROCESS_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                      "os.forkpty", "pty.spawn")

    def __init__(self, path: Path):
        self.path, self.armed, self.events = path, False, []
        sys.addaudithook(self.hook)

    def hook(self, event, args):
        if not self.armed:
            return
        if event in self.PROCESS_EVENTS:
            self.events.append(f"{event} {str(args)[:100]}")
        elif event == "open" and args and CANARY in str(args[0]):
            self.events.append(f"open {args[0]}")
        elif event in ("exec", "compile"):  # source text run; imports exec code objects of real files
            where = getattr(args[0], "co_filename", None) if event == "exec" else args[1]
            if not str(where).startswith("/"):
                self.events.append(f"{event} {str(where)[:60]}")

    def take(self) -> list[str]:
        found = list(self.events)
        if self.path.exists():
            found.append(f"{self.path.name} created")
            self.path.unlink()
        self.events.clear()
        return found


def walk_tensors(obj, read) -> int:
    """Call read on every LazyTensor in a tree of dicts, lists and tuples (cycles and depth cut off); how many."""
    from conversions.torch_lazy import LazyTensor

    seen, stack, n = set(), [obj], 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, LazyTensor):
            read(item)
            n += 1
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return n


# Files whose every byte a reader vouches for: a mutation of one that changed its bytes must be refused.
PROTECTED = {"seal": {SEAL_MARKER, "global_step3/weights.bin"}, "manifest": {"config.json"}}

# Library errors that count as a refusal, by exception type and the module that raised it (the innermost frame), each
# a parse error the library documents. Everything else that is not baton's own Refused is a finding.
DOCUMENTED_PARSE_ERRORS = {
    ("SafetensorError", "conversions.hf"): "safetensors.safe_open: SafetensorError on a malformed header or buffer",
}


def load_case(fmt: str, folder: Path) -> tuple[str, str | None]:
    """Baton's reader of fmt on folder, every tensor read: ('loaded', None), or ('refused', the check that refused)
    where the reader answers with a verdict instead of raising Refused."""
    from conversions import hf, megatron, sealed, torch_dist, torch_lazy, verify

    if fmt == "zero":
        walk_tensors(torch_lazy.load(folder / "mp_rank_00_model_states.pt"), lambda t: t.load())
    elif fmt == "megatron":
        reader = megatron.DistReader(folder)
        for key, entry in reader.metadata.state_dict_metadata.items():
            if isinstance(entry, torch_dist.TensorEntry):
                reader.read_full(key)
        walk_tensors(megatron.read_common(folder), lambda t: t.load())
    elif fmt == "safetensors":
        hf.read_header(folder / "model.safetensors")
        for _, tensor in hf.iter_tensors(folder):
            tensor.clone()
    elif fmt == "manifest":
        if not all(c["passed"] for c in verify.integrity(folder)):
            return "refused", "verify.integrity"
    elif fmt == "seal":
        if sealed.problem(folder, SEAL_MARKER):
            return "refused", "sealed.problem"
    return "loaded", None


def load_reader(spec: str | None):
    """The reader a run uses: load_case, or PATH:FUNCTION (a planted one, to show that the harness catches it)."""
    if not spec:
        return load_case
    import importlib.util

    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def baton_frame(e: BaseException) -> str | None:
    """The deepest frame of baton's own code the exception passed through (file:line function)."""
    import traceback

    ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(str(REPO / "conversions"))]
    return f"{Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].lineno} {ours[-1].name}" if ours else None


def origin(e: BaseException) -> str:
    """The module of the innermost Python frame the exception was raised in (or passed through, when raised in C)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "?") if tb is not None else "?"


def classify(e: BaseException) -> str:
    """'refused' for baton's own Refused or a documented library parse error from its known origin, else
    'unexpected'."""
    from conversions.refusal import Refused

    if isinstance(e, Refused) or (type(e).__name__, origin(e)) in DOCUMENTED_PARSE_ERRORS:
        return "refused"
    return "unexpected"


def run_one(spec: dict, seeds: Path, scratch: Path, canary: Canary, reader=load_case,
            announce=lambda what: None) -> dict:
    fmt = spec["format"]
    rng = random.Random(spec["case_seed"])
    folder = scratch / "case"
    shutil.rmtree(folder, ignore_errors=True)
    changed = False
    if fmt == "control":
        name = spec["payload"]
        data, what = b"\x80\x04" + payloads(str(canary.path))[name] + b".", f"plain pickle.loads of {name}"
    else:
        shutil.copytree(seeds / fmt, folder)
        what, changed = mutate(folder, fmt, rng, str(canary.path))
    announce(what)  # the parent knows the case before the reader runs: a hang or a crash is then named
    t0 = time.perf_counter()
    result = {"i": spec["i"], "format": fmt, "mutation": what}
    canary.armed = True
    try:
        if fmt == "control":
            pickle.loads(data)  # the control: no restricted loader at all
            result["outcome"] = "loaded"
        else:
            result["outcome"], result["error"] = reader(fmt, folder)
    except BaseException as e:  # noqa: BLE001 - a refusal is named; every other exception is a finding, named too
        result.update(outcome=classify(e), error=type(e).__name__, origin=origin(e))
        if result["outcome"] == "unexpected":
            result.update(message=str(e)[:300], where=baton_frame(e))
    finally:
        canary.armed = False
    protected = what.split(":", 1)[0] in PROTECTED.get(fmt, ())
    if result["outcome"] == "loaded" and protected and changed:
        result["outcome"] = "accepted"  # a file the reader vouches for changed, and it said nothing
    result["executed"] = canary.take()
    result["seconds"] = time.perf_counter() - t0
    result["rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return result


def worker(seeds: Path, scratch: Path, reader_spec: str | None = None) -> None:
    """Read case specs (JSON lines) on stdin, answer on the original stdout; anything printed goes to stderr."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.path.insert(0, str(REPO))
    os.environ["BATON_SEAL_KEY"] = str(seeds / "seal.key")
    scratch.mkdir(parents=True, exist_ok=True)
    os.chdir(scratch)
    reader = load_reader(reader_spec)
    canary = Canary(scratch / CANARY)
    for fmt in TARGETS:  # imports and first-use paths done before the hook is armed
        load_case(fmt, seeds / fmt)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        spec = json.loads(line)
        announce = lambda what: answers.write(json.dumps({"started": spec["i"], "mutation": what}) + "\n")  # noqa
        answers.write(json.dumps(run_one(spec, seeds, scratch, canary, reader, announce)) + "\n")


# ---- the parent -----------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, n: int, seeds: Path, out: Path, reader: str | None = None):
        self.n, self.seeds, self.out, self.buf, self.reader = n, seeds, out, b"", reader
        self.log = open(out / f"worker-{n}.log", "ab")
        self.proc = None
        self.peak_rss_kb = 0

    def start(self) -> None:
        self.buf = b""
        reader = ["--reader", self.reader] if self.reader else []
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(self.seeds),
                                      str(self.out / f"worker-{self.n}"), *reader], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=REPO)
        ready = self.read(120.0)
        if not (ready and ready.get("ready")):
            raise RuntimeError(f"fuzz worker {self.n} did not start: see {self.log.name}")

    def read(self, timeout: float) -> dict | None:
        """The next answer line; None on timeout or when the worker died."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, spec: dict) -> None:
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()

    def stop(self, kill: bool) -> int:
        """Stop the worker; its exit status as Popen reports it (negative: the signal)."""
        if kill:
            self.proc.kill()
        else:
            self.proc.stdin.close()
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.peak_rss_kb = max(self.peak_rss_kb, usage.ru_maxrss)
        self.proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.proc.stdout.close()
        return self.proc.returncode


def run_cases(specs: list[dict], seeds: Path, out: Path, workers: int, timeout: float,
              reader: str | None = None) -> tuple[list[dict], int]:
    """Every spec through the workers; results in spec order, and the workers' peak RSS (KiB)."""
    todo: queue.Queue = queue.Queue()
    for spec in specs:
        todo.put(spec)
    results: list[dict] = []
    lock = threading.Lock()
    pool = [Worker(n, seeds, out, reader) for n in range(workers)]
    errors: list[BaseException] = []

    def drive(w: Worker):
        try:
            w.start()
            while True:
                try:
                    spec = todo.get_nowait()
                except queue.Empty:
                    break
                w.send(spec)
                started = w.read(timeout)
                answer = w.read(timeout) if started else None
                if answer is None:  # a hang or a death: the worker goes, the case is counted, a new worker comes
                    alive = w.proc.poll() is None
                    code = w.stop(kill=True) if alive else w.stop(kill=False)
                    answer = {"i": spec["i"], "format": spec["format"], "case_seed": spec["case_seed"],
                              "mutation": (started or {}).get("mutation"),
                              "executed": [], "outcome": "hang" if alive else "worker died",
                              "error": None if alive else (signal.Signals(-code).name if code < 0 else f"exit {code}")}
                    w.start()
                else:
                    w.peak_rss_kb = max(w.peak_rss_kb, answer.pop("rss_kb"))
                    answer["case_seed"] = spec["case_seed"]
                with lock:
                    results.append(answer)
            w.stop(kill=False)
        except BaseException as e:  # noqa: BLE001 - surfaced after the join
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(w,)) for w in pool]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: r["i"]), max(w.peak_rss_kb for w in pool)


def make_specs(cases: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    formats, weights = zip(*FORMAT_WEIGHTS.items())
    return [{"i": i, "format": rng.choices(formats, weights)[0], "case_seed": rng.getrandbits(62)}
            for i in range(cases)]


def control_specs() -> list[dict]:
    return [{"i": i, "format": "control", "payload": name, "case_seed": 0} for i, name in enumerate(CODE_RUNNING)]


def family(mutation: str | None) -> str:
    m = mutation or ""
    for key, name in (("pickle splice", "pickle splice"), ("plain pickle.loads", "control"),
                      (": pickle ", "pickle length"),
                      ("zip ", "zip length"), ("safetensors header length", "safetensors length"), ("JSON", "JSON")):
        if key in m:
            return name
    return "bytes" if m else "unknown"


FINDINGS = ("unexpected", "accepted", "hang", "worker died")


def summarize(results: list[dict], peak_rss_kb: int, seconds: float) -> dict:
    table: dict[str, Counter] = {}
    by_family: dict[str, Counter] = {}
    for r in results:
        table.setdefault(r["format"], Counter())[r["outcome"]] += 1
        by_family.setdefault(family(r.get("mutation")), Counter())[r["outcome"]] += 1
    findings = [r for r in results if r["outcome"] in FINDINGS or r["executed"]]
    return {"cases": len(results), "table": {f: dict(c) for f, c in sorted(table.items())},
            "by_mutation": {f: dict(c) for f, c in sorted(by_family.items())},
            "executed": sum(1 for r in results if r["executed"]),
            "signals": sum(1 for r in results
                           if r["outcome"] == "worker died" and str(r.get("error")).startswith("SIG")),
            "worker_exits": sum(1 for r in results if r["outcome"] == "worker died"),
            "hangs": sum(1 for r in results if r["outcome"] == "hang"),
            "accepted": sum(1 for r in results if r["outcome"] == "accepted"),
            "unexpected": dict(Counter(r["error"] for r in results if r["outcome"] == "unexpected")),
            "unexpected_where": dict(Counter(f"{r['error']} from {r.get('origin')} at {r.get('where')}" for r in results
                                             if r["outcome"] == "unexpected")),
            "refusal_types": dict(Counter(f"{r.get('error')} from {r.get('origin', 'its verdict')}" for r in results
                                          if r["outcome"] == "refused")),
            "peak_worker_rss_mb": round(peak_rss_kb / 1024, 1), "seconds": round(seconds, 1),
            "cases_per_s": round(len(results) / seconds, 1) if seconds else None,
            "findings": findings[:200]}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": cpu, "loadavg": os.getloadavg(), "python": platform.python_version()}


def run(cases: int, seed: int, out: Path, workers: int = 2, timeout: float = CASE_TIMEOUT_S,
        reader: str | None = None) -> dict:
    """Build the seeds under out, run the cases and the control through the same workers, and return the summary."""
    out = Path(out)
    shutil.rmtree(out / "seeds", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    seeds = build_seeds(out / "seeds")
    specs = make_specs(cases, seed)
    specs += [{**c, "i": cases + c["i"]} for c in control_specs()]
    t0 = time.perf_counter()
    results, peak = run_cases(specs, seeds, out, workers, timeout, reader)
    summary = summarize([r for r in results if r["format"] != "control"], peak, time.perf_counter() - t0)
    summary["control"] = {r["mutation"]: r["executed"] for r in results if r["format"] == "control"}
    summary["control_tripped"] = sum(1 for found in summary["control"].values()
                                     if any(f.endswith(f"{CANARY} created") for f in found))
    return summary


def format_table(s: dict) -> str:
    outcomes = ["loaded", "refused", "accepted", "unexpected", "hang", "worker died"]
    rows = [f"{'format':<19}" + "".join(f"{o:>12}" for o in outcomes)]
    for fmt, counts in s["table"].items():
        rows.append(f"{fmt:<19}" + "".join(f"{counts.get(o, 0):>12}" for o in outcomes))
    rows.append(f"{'mutation':<19}" + "".join(f"{o:>12}" for o in outcomes))
    for fam, counts in s["by_mutation"].items():
        rows.append(f"{fam:<19}" + "".join(f"{counts.get(o, 0):>12}" for o in outcomes))
    rows.append(f"control: {s['control_tripped']} of {len(s['control'])} payloads run by plain pickle.loads in the "
                "same workers tripped the canary")
    rows.append(f"cases {s['cases']}  executed {s['executed']}  signals {s['signals']}  hangs {s['hangs']}  "
                f"accepted {s['accepted']}  unexpected {sum(s['unexpected'].values())}  "
                f"peak worker RSS {s['peak_worker_rss_mb']} MB (limit {MEMORY_LIMIT >> 30} GiB address space)  "
                f"{s['seconds']} s ({s['cases_per_s']} cases/s)")
    if s["unexpected"]:
        rows += [f"unexpected: {n} × {where}" for where, n in s["unexpected_where"].items()]
    rows += [f"FAILED: {f}" for f in failures(s)]
    return "\n".join(rows)


def failures(s: dict) -> list[str]:
    """Why this run fails (empty: it passes). `make fuzz` and tests/test_fuzz.py both judge by this."""
    found = [f"{s[key]} {what}" for key, what in (
        ("executed", "case(s) ran a payload"), ("signals", "worker(s) killed by a signal"),
        ("worker_exits", "worker(s) exited"), ("hangs", "hang(s)"),
        ("accepted", "changed protected file(s) accepted"))
        if s[key]]
    if s["unexpected"]:
        found.append(f"{sum(s['unexpected'].values())} unexpected exception(s): "
                     + ", ".join(f"{n} × {w}" for w, n in s["unexpected_where"].items()))
    if s["control_tripped"] != len(CODE_RUNNING):
        found.append(f"the canary tripped on {s['control_tripped']} of {len(CODE_RUNNING)} control payloads")
    return found


def readme_line(s: dict) -> str:
    """The figures the README and docs quote, as this harness words them."""
    return (f"{s['cases']:,} cases, {s['executed']} payloads executed, {s['signals']} workers killed by a signal, "
            f"{s['hangs']} hangs, {sum(s['unexpected'].values())} unexpected exceptions, {s['accepted']} changed "
            f"sealed or manifested files accepted, peak worker RSS {round(s['peak_worker_rss_mb'])} MB.")


def docs_block(r: dict) -> str:
    """The run as docs/reliability-and-security.md shows it, from a result file's content."""
    when = r["started"].replace("T", " ")[:16] + " UTC"
    outcomes = ("loaded", "refused", "accepted")
    rows = [f"`make fuzz`, one whole run (`benchmarks/results/fuzz.json`: {when}, seed {r['seed']}, {r['workers']} "
            f"workers under a {r['memory_limit_bytes'] >> 30} GiB",
            f"`RLIMIT_AS`, {r['case_timeout_s']:g} s per case; see **Fuzzing** above for what is mutated and how a "
            "payload that runs is detected):", "",
            "| cases | payload executed | worker killed by a signal | hangs | unexpected exceptions | changed files "
            "accepted | peak worker RSS | control: plain pickle ran |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {r['cases']:,} | {r['executed']} | {r['signals']} | {r['hangs']} | {sum(r['unexpected'].values())} | "
            f"{r['accepted']} | {round(r['peak_worker_rss_mb'])} MB | {r['control_tripped']} of {len(r['control'])} |",
            "", "| reader | " + " | ".join(outcomes) + " |", "|---|" + "---:|" * len(outcomes)]
    rows += [f"| {fmt} | " + " | ".join(f"{counts.get(o, 0):,}" for o in outcomes) + " |"
             for fmt, counts in r["table"].items()]
    rows += ["", "| refused by | cases |", "|---|---:|"]
    rows += [f"| {how} | {n:,} |" for how, n in sorted(r["refusal_types"].items(), key=lambda kv: -kv[1])]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="work folder: seeds, worker scratch and logs (required)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per case before a hang is counted")
    p.add_argument("--result", type=Path, default=RESULT)
    p.add_argument("--reader", help="PATH:FUNCTION read instead of baton's readers (a planted broken one, in tests)")
    p.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker, a.reader)
        return 0
    if a.out is None:
        p.error("--out is required")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    at_start = machine()
    s = run(a.cases, a.seed, a.out, a.workers, a.timeout, a.reader)
    print(format_table(s))
    print(f"README: {readme_line(s)}")
    a.result.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"started": started, "seed": a.seed, "workers": a.workers, "memory_limit_bytes": MEMORY_LIMIT,
                       "case_timeout_s": a.timeout, "machine_at_start": at_start, "machine_at_end": machine(), **s},
                      indent=1)
    a.result.write_text(text.replace(str(a.out.resolve()), "WORK_DIR") + "\n")  # the result names no local path
    print(f"result: {a.result}\nfor docs/reliability-and-security.md (tests/test_fuzz.py checks it is there):\n"
          + docs_block(json.loads(text)))
    return 1 if failures(s) else 0


if __name__ == "__main__":
    sys.exit(main())
