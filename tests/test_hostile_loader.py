"""Issue 25, the one restricted loader: crafted bytes in a checkpoint's pickles (`.metadata`, `common.pt`, ZeRO
`*_states.pt`, the tensor blobs of `.distcp` files) are refused with one message naming the file; nothing runs,
nothing crashes, nothing outside the checkpoint folder is read, nothing is allocated beyond what the file holds. And
Megatron→HF reads a torch_dist checkpoint without importing torch.distributed.checkpoint, whose loader re-reads
`.metadata` with plain pickle."""
from __future__ import annotations

import argparse
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conversions import megatron, torch_lazy

pytestmark = [pytest.mark.fast, pytest.mark.reliability]
REPO = Path(__file__).resolve().parents[1]
ARCH = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_query_groups": 1, "ffn_hidden_size": 16,
        "vocab_size": 10, "seq_length": 32, "tie_word_embeddings": False}


def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _megatron_state(seed: int = 0) -> dict:
    """The weights of a tiny Megatron GPT, as torch_dist stores them (layers stacked, vocabulary padded to 16)."""
    g = torch.Generator().manual_seed(seed)
    L, h, ffn, qkv = 2, 8, 16, (2 + 2 * 1) * 4

    def r(*shape):
        return torch.randn(*shape, generator=g)

    layer = megatron.LAYER
    return {megatron.EMBEDDING: r(16, h), megatron.OUTPUT: r(16, h), megatron.FINAL_NORM: r(h),
            layer["input_norm"]: r(L, h), layer["qkv"]: r(L, qkv, h), layer["proj"]: r(L, h, h),
            layer["mlp_norm"]: r(L, h), layer["fc1"]: r(L, 2 * ffn, h), layer["fc2"]: r(L, h, ffn)}


def _dist_checkpoint(root: Path, state: dict | None = None) -> Path:
    import torch.distributed.checkpoint as dcp  # the writer (what Megatron and from_hf use), not the reader under test

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state or _megatron_state(), checkpoint_id=str(root), no_dist=True)
    torch.save({megatron.ARCH_KEY: ARCH}, root / megatron.COMMON_FILE)
    (root / megatron.METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    return root


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run a victim in its own process: a crash is a signal in returncode, not the end of the test session."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=240)


# ---- 1. code runs: a dotted global under an inert-placeholder module ----------------------------------------------
def _dotted_exec(canary: Path, opcode: str) -> bytes:
    """`enum.bltns.exec(code)`: enum imports builtins as bltns, so plain pickle (protocol 4) resolves builtins.exec."""
    code = f"open({str(canary)!r}, 'w').close()"
    global_ = _s("enum") + _s("bltns.exec") + b"\x93" if opcode == "STACK_GLOBAL" else b"cenum\nbltns.exec\n"
    return b"\x80\x04" + global_ + _s(code) + b"\x85R."


@pytest.mark.parametrize("opcode", ["STACK_GLOBAL", "GLOBAL"])
@pytest.mark.parametrize("victim", ["DistReader", "architecture", "verify"])
def test_dotted_global_in_metadata_runs_nothing(tmp_path, opcode, victim, record_property):
    record_property("fault", "crafted .metadata: protocol-4 dotted global (enum.bltns.exec)")
    from conversions import verify

    canary = tmp_path / "pwned"
    root = _dist_checkpoint(tmp_path / "ckpt")
    (root / ".metadata").write_bytes(_dotted_exec(canary, opcode))
    call = {"DistReader": lambda: megatron.DistReader(root), "architecture": lambda: megatron.architecture(root),
            "verify": lambda: list(verify._megatron_tensors(root))}[victim]
    with pytest.raises(megatron.MegatronCheckpointError, match=r"\.metadata: refers to enum\.bltns\.exec: a dotted"):
        call()
    assert not canary.exists()


def test_stack_global_from_unknown_strings_refused():
    """STACK_GLOBAL's module and name must be the strings pushed just before it, so the scan knows what it names."""
    data = b"\x80\x04" + _s("builtins") + _s("exec") + b"\x86" + b"\x94" + b"0" + b"h\x00" + b"\x93."
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match="STACK_GLOBAL"):
        torch_lazy.safe_loads(data, "inline")


# ---- 2. crashes: NEWOBJ_EX on the real torch classes ----------------------------------------------------------------
def _newobj_ex(cls: str) -> bytes:
    """torch.Tensor(cdata=N) / torch.UntypedStorage(8, allocator=N): torch takes the integer for a pointer."""
    args, kw = (b")", "cdata") if cls == "Tensor" else (b"K\x08\x85", "allocator")
    return b"\x80\x04" + _s("torch") + _s(cls) + b"\x93" + args + b"}" + _s(kw) + b"J" + struct.pack("<i", 0x0deadbee) \
        + b"s\x92."


def _zip_pickle(path: Path, data_pkl: bytes, records: dict | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", sys.byteorder)
        for key, data in (records or {}).items():
            z.writestr(f"archive/data/{key}", data)
    return path


@pytest.mark.parametrize("cls", ["Tensor", "UntypedStorage"])
@pytest.mark.parametrize("victim", ["zero.open_checkpoint", "megatron.architecture"])
def test_newobj_ex_on_torch_classes_is_refused_without_a_crash(tmp_path, cls, victim, record_property):
    record_property("fault", "crafted pickle: NEWOBJ_EX on torch.Tensor / UntypedStorage (pointer)")
    payload = _newobj_ex(cls)
    if victim == "zero.open_checkpoint":
        root = tmp_path / "zero"
        (root / "global_step1").mkdir(parents=True)
        (root / "latest").write_text("global_step1")
        for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
            _zip_pickle(root / "global_step1" / name, payload)
        call = f"from conversions import zero; zero.open_checkpoint({str(root)!r})"
    else:
        root = _dist_checkpoint(tmp_path / "ckpt")
        (root / ".metadata").write_bytes(payload)
        call = f"from conversions import megatron; megatron.architecture({str(root)!r})"
    r = _run_isolated(f"""
        from conversions.torch_lazy import UnsafeCheckpointError
        from conversions.megatron import MegatronCheckpointError
        try:
            {call}
        except (UnsafeCheckpointError, MegatronCheckpointError) as e:
            print("REFUSED", e)
        """)
    assert r.returncode >= 0, f"killed by {signal.Signals(-r.returncode).name}"
    assert r.returncode == 0 and "REFUSED" in r.stdout and "opcode NEWOBJ_EX" in r.stdout, r.stdout + r.stderr


# ---- 3. escapes: storage paths outside the checkpoint folder --------------------------------------------------------
def _rewrite_storage_paths(root: Path, new_path) -> None:
    """Point every storage entry of `.metadata` elsewhere (the test writes it with torch's own classes)."""
    md = pickle.loads((root / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = new_path(info.relative_path)
    (root / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_storage_outside_the_checkpoint_is_refused(tmp_path, how, record_property):
    record_property("fault", "crafted .metadata: storage path outside the folder (absolute, .., symlink)")
    secret = _dist_checkpoint(tmp_path / "secret", _megatron_state(seed=7))
    root = _dist_checkpoint(tmp_path / "ckpt")
    if how == "absolute":
        _rewrite_storage_paths(root, lambda rel: str(secret / rel))
    elif how == "dotdot":
        _rewrite_storage_paths(root, lambda rel: f"../secret/{rel}")
    else:
        for f in root.glob("*.distcp"):
            f.unlink()
            f.symlink_to(secret / f.name)
    with pytest.raises(megatron.MegatronCheckpointError, match=r"refused"):
        megatron.DistReader(root).read_full(megatron.EMBEDDING)


# ---- 4. amplification: allocations the file does not pay for --------------------------------------------------------
def test_bytearray_bomb_refused(tmp_path, record_property):
    record_property("fault", "crafted pickle: 33-byte bytearray(256 MiB)")
    data = b"\x80\x02c__builtin__\nbytearray\nJ" + struct.pack("<i", 256 << 20) + b"\x85R."
    assert len(data) == 33
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match=r"builtins\.bytearray.*allowlist"):
        torch_lazy.safe_loads(data, "inline")
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match=r"states\.pt: refers to builtins\.bytearray"):
        torch_lazy.load(_zip_pickle(tmp_path / "optim_states.pt", data))


def test_memo_index_bomb_refused():
    """LONG_BINPUT 2^32-1: the C unpickler would size its memo to the index (32 GiB of pointers)."""
    data = b"\x80\x02N" + b"r" + struct.pack("<I", 0xFFFFFFFF) + b"."
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match="memo index"):
        torch_lazy.safe_loads(data, "inline")


class _StoredTensor:
    """Pickles as torch's tensor rebuild on one storage record, with the view numbers a crafted file would carry."""

    def __init__(self, offset, size, stride):
        self.args = (offset, size, stride)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (_STORAGE, *self.args, False, OrderedDict())


_STORAGE = object()


def _crafted_tensor_file(path: Path, offset: int, size: tuple, stride: tuple) -> Path:
    """A torch.save-format zip whose only storage holds one float32 (4 bytes)."""
    import io

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 1) if obj is _STORAGE else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": _StoredTensor(offset, size, stride)})
    return _zip_pickle(path, buf.getvalue(), {"0": struct.pack("<f", 1.0)})


@pytest.mark.parametrize("offset, size, stride", [
    (0, (1 << 20, 1 << 20), (0, 0)),   # broadcast: 4 bytes expanded to 4 TiB by as_strided(...).contiguous()
    (0, (1 << 16,), (1 << 14,)),       # strides past the storage
    (1 << 40, (1,), (1,)),             # offset past the storage
])
def test_view_beyond_its_storage_refused_before_any_read(tmp_path, offset, size, stride, record_property):
    record_property("fault", "crafted tensor view: shape/stride/offset beyond its 4-byte storage")
    f = _crafted_tensor_file(tmp_path / "model_states.pt", offset, size, stride)
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match="beyond its storage of 1 elements"):
        torch_lazy.load(f)


def test_genuine_view_in_bounds_still_reads(tmp_path):
    f = _crafted_tensor_file(tmp_path / "ok.pt", 0, (1,), (1,))
    assert torch.equal(torch_lazy.load(f)["w"].load(), torch.tensor([1.0]))


# ---- 5. check, then re-read: Megatron's loader unpickles `.metadata` again with plain pickle --------------------------
class _OpensFile:
    """Pickles as `argparse.FileType('w')(path)`: for baton's reader a placeholder called with a string, for plain
    pickle a file opened for writing."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return argparse.FileType("w"), (self.path,)


def plant_plain_pickle_payload(root: Path, canary: Path) -> None:
    """An extra field in `.metadata` that baton's reader keeps as an inert record and plain pickle runs (creating
    the canary): the reader accepts the file, so only never letting Megatron re-read it keeps the payload inert."""
    md = pickle.loads((root / ".metadata").read_bytes())  # torch's writer's file, just written by the test
    md.planner_notes = _OpensFile(canary)
    (root / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


def test_pretrain_starts_from_baton_s_rewrite_of_a_foreign_checkpoint(tmp_path, monkeypatch, record_property):
    """The pretrain task hands Megatron the input only when this BATON_HOME sealed it; any other torch_dist folder
    becomes a fresh one baton writes from the tensors its reader parsed: the same bits, and no payload."""
    record_property("fault", "crafted .metadata that only plain pickle runs, as --from")
    from conversions import sealed
    from tasks.pretrain.task import SEAL, loadable_input
    from tasks.stage import StageContext

    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(sealed.KEY_ENV, raising=False)
    canary = tmp_path / "canary"
    src = _dist_checkpoint(tmp_path / "foreign")
    plant_plain_pickle_payload(src, canary)
    ctx = StageContext(stage="pretrain", run_id="t", run_dir=tmp_path, work_dir=tmp_path / "work", model={}, seed=0,
                       input=src, input_format="megatron-dist")
    loaded, why = loadable_input(ctx)
    assert loaded == tmp_path / "work" / "input" and why == "no baton_state.json (the save did not finish)", why
    assert sealed.problem(loaded, SEAL) is None and not canary.exists()
    assert pickle.loads((loaded / ".metadata").read_bytes()) and not canary.exists()  # nothing left to run
    rewritten = megatron.DistReader(loaded)
    for key, tensor in _megatron_state().items():
        assert torch.equal(rewritten.read_full(key), tensor), key
    ctx.input = loaded  # a folder this BATON_HOME sealed (its own output, an HF import) is loaded as it is
    assert loadable_input(ctx) == (loaded, None)
    pickle.loads((src / ".metadata").read_bytes()).planner_notes.close()  # the control: plain pickle runs it
    assert canary.exists()


# ---- the reader itself: exact, and without torch.distributed.checkpoint ---------------------------------------------
def test_megatron_to_hf_reads_exactly_without_torch_distributed_checkpoint(tmp_path):
    """Convert in a fresh process: the HF tensors are the stored ones (rows past the vocabulary dropped, qkv and fc1
    split), and torch.distributed.checkpoint was never imported (nor by the verify read-back)."""
    from conversions import manifest as mf

    root = _dist_checkpoint(tmp_path / "ckpt")
    mf.write(root, mf.build(root, format="megatron-dist", stage="external", architecture=ARCH))
    r = _run_isolated(f"""
        import sys
        from conversions import megatron, verify
        megatron.to_hf({str(root)!r}, {str(tmp_path / 'hf')!r}, max_shard_bytes=2000)
        report = verify.verify({str(root)!r})
        checks = [c["name"] for c in report["checks"] if c["passed"]]
        print("DCP", "torch.distributed.checkpoint" in sys.modules, "L1.reload" in checks, report["passed"])
        """)
    assert r.returncode == 0, r.stderr
    assert "DCP False True True" in r.stdout, r.stdout
    state, got = _megatron_state(), _load_hf(tmp_path / "hf")
    q, k, v = megatron.split_qkv(state[megatron.LAYER["qkv"]][1], 2, 1, 4)
    assert torch.equal(got["model.embed_tokens.weight"], state[megatron.EMBEDDING][:10])
    assert torch.equal(got["lm_head.weight"], state[megatron.OUTPUT][:10])
    assert torch.equal(got["model.layers.1.self_attn.k_proj.weight"], k)
    assert torch.equal(got["model.layers.1.self_attn.v_proj.weight"], v)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], state[megatron.LAYER["fc1"]][0][16:])
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], state[megatron.LAYER["fc2"]][1])
    assert torch.equal(got["model.norm.weight"], state[megatron.FINAL_NORM])


def _load_hf(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def _two_chunk_checkpoint(root: Path, full: torch.Tensor) -> Path:
    """`w` stored as two row chunks in one .distcp file, the way two TP ranks' writes end up (built with torch's own
    metadata classes: the format under test, written by the test)."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    root.mkdir()
    blobs, chunks, storage, pos = b"", [], {}, 0
    for lo, hi in ((0, 1), (1, 4)):
        buf = io.BytesIO()
        torch.save(full[lo:hi].clone(), buf)
        chunks.append(ChunkStorageMetadata(torch.Size([lo, 0]), torch.Size([hi - lo, full.shape[1]])))
        storage[MetadataIndex("w", torch.Size([lo, 0]))] = _StorageInfo("__0_0.distcp", pos, len(buf.getvalue()))
        blobs, pos = blobs + buf.getvalue(), pos + len(buf.getvalue())
    (root / "__0_0.distcp").write_bytes(blobs)
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, chunks)},
                  storage_data=storage)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    (root / megatron.METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    return root


def test_chunks_of_a_sharded_tensor_are_assembled(tmp_path):
    """A box across chunk borders reads exactly what torch's own loader reads (the reference, on a trusted file)."""
    import torch.distributed.checkpoint as dcp

    full = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    root = _two_chunk_checkpoint(tmp_path / "ckpt", full)
    theirs = {"w": torch.empty(4, 6, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(theirs, checkpoint_id=str(root), no_dist=True)
    r = megatron.DistReader(root)
    assert torch.equal(r.read_full("w"), theirs["w"]) and torch.equal(theirs["w"], full)
    assert torch.equal(r.read({"w": ((0, 2), (3, 3))})["w"], full[0:3, 2:5])


def test_lazy_range_is_not_expanded_by_a_set(record_property):
    """set(range(2^60)): 60-odd bytes that would iterate forever and allocate without bound."""
    record_property("fault", "crafted pickle: set(range(2^60))")
    data = (b"\x80\x02c__builtin__\nset\nc__builtin__\nrange\n\x8a\x08" + (1 << 60).to_bytes(8, "little")
            + b"\x85R\x85R.")
    with pytest.raises(torch_lazy.UnsafeCheckpointError, match="set of a range"):
        torch_lazy.safe_loads(data, "inline")


def test_json_nested_deeper_than_the_parser_goes_is_refused_not_a_crash(tmp_path):
    """Found by `make fuzz`: a 100,000-deep JSON document raised RecursionError out of four readers."""
    import struct

    from conversions import hf, manifest as mf, sealed

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / mf.MANIFEST_NAME).write_text(deep)
    with pytest.raises(mf.ManifestError, match="not valid JSON"):
        mf.read(tmp_path)
    (tmp_path / "baton_complete.json").write_text(deep)
    assert sealed.read(tmp_path, "baton_complete.json") is None
    header = deep.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="nests too deep"):
        hf.read_header(tmp_path / "model.safetensors")
