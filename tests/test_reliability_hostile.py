"""Hostile checkpoints (issue 12, item 7): crafted pickles that would create a file on load are refused with a
message naming the file and the global, and the file is not created."""
from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch

from conversions import megatron, torch_lazy, zero

pytestmark = [pytest.mark.fast, pytest.mark.reliability]


class _Payload:
    """Pickles as a call of `func(*args)`: what an attacker puts into a checkpoint."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(target):
    return {
        "builtins.open": _Payload(open, str(target), "w"),
        "os.system": _Payload(os.system, f"touch {target}"),
        "torch.save": _Payload(torch.save, {}, str(target)),
        "builtins.exec": _Payload(exec, f"open({str(target)!r}, 'w').close()"),
    }


def _torch_file(path, obj):
    torch.save(obj, path)
    return path


def _zero_tag(root, optim_obj=None, model_obj=None):
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    good_optim = {"optimizer_state_dict": {"zero_stage": 1, "partition_count": 1,
                                           "single_partition_of_fp32_groups": [torch.zeros(4)]}}
    torch.save(optim_obj or good_optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save(model_obj or {"param_shapes": [{"w": torch.Size([4])}], "buffer_names": []},
               tag / "mp_rank_00_model_states.pt")
    return root


@pytest.mark.parametrize("kind", ["builtins.open", "os.system", "torch.save", "builtins.exec"])
def test_zero_optimizer_and_model_states_refused(tmp_path, kind, record_property):
    record_property("fault", "crafted ZeRO *_states.pt")
    for which in ("optim", "model"):
        target = tmp_path / f"pwned-{which}"
        payload = {"optimizer_state_dict": {"zero_stage": 1, "loss_scaler": _payloads(target)[kind]}}
        root = _zero_tag(tmp_path / which, **{f"{which}_obj": payload})
        with pytest.raises(torch_lazy.UnsafeCheckpointError, match=r"states\.pt: refers to .*allowlist"):
            zero.open_checkpoint(root)
        assert not target.exists(), f"{kind} in the {which} file ran"


class ZeroStageEnum:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return ZeroStageEnum, (self.value,)


def test_engine_classes_stay_inert_placeholders(record_property):
    record_property("fault", "(control) DeepSpeed objects read inert")
    """DeepSpeed's own objects (a stage enum, a loss scaler) are read without importing or running DeepSpeed."""
    data = pickle.dumps({"zero_stage": ZeroStageEnum(2)}, protocol=2)
    data = data.replace(b"test_reliability_hostile", b"deepspeed.runtime.zero")
    obj = torch_lazy.safe_loads(data, "inline")
    assert type(obj["zero_stage"]).__module__.startswith("opaque.deepspeed") and int(obj["zero_stage"]) == 2


def test_safe_tensors_and_containers_still_load(tmp_path, record_property):
    record_property("fault", "(control) genuine torch.save file loads")
    f = _torch_file(tmp_path / "ok.pt", {"w": torch.arange(6.0).view(2, 3), "d": torch.bfloat16,
                                         "s": torch.Size([2]), "set": {1, 2}})
    obj = torch_lazy.load(f)
    assert torch.equal(obj["w"].load(), torch.arange(6.0).view(2, 3)) and obj["d"] is torch.bfloat16


def _dist_checkpoint(root):
    import torch.distributed.checkpoint as dcp
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"embedding.word_embeddings.weight": torch.zeros(4, 2)}, checkpoint_id=str(root), no_dist=True)
    (root / megatron.METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    return root


@pytest.mark.parametrize("kind", ["builtins.open", "os.system", "torch.save"])
def test_megatron_common_pt_refused(tmp_path, kind, record_property):
    record_property("fault", "crafted Megatron common.pt")
    target = tmp_path / "pwned"
    root = _dist_checkpoint(tmp_path / "ckpt")
    torch.save({megatron.ARCH_KEY: {"num_layers": 1}, "x": _payloads(target)[kind]}, root / megatron.COMMON_FILE)
    with pytest.raises(megatron.MegatronCheckpointError, match=r"common\.pt: refused"):
        megatron.architecture(root)
    assert not target.exists()


def test_dist_checkpoint_metadata_pickle_refused(tmp_path, record_property):
    record_property("fault", "crafted DCP .metadata")
    target = tmp_path / "pwned"
    root = _dist_checkpoint(tmp_path / "ckpt")
    megatron.DistReader(root)  # the genuine one passes the allowlist
    (root / ".metadata").write_bytes(pickle.dumps(_payloads(target)["os.system"]))
    with pytest.raises(megatron.MegatronCheckpointError, match=r"\.metadata: refers to (posix|os)\.system"):
        megatron.DistReader(root)
    with pytest.raises(megatron.MegatronCheckpointError):
        megatron.architecture(root)
    assert not target.exists()


def test_zip_with_compressed_pickle_is_not_a_bypass(tmp_path, record_property):
    record_property("fault", "crafted torch.save zip")
    f = tmp_path / "evil.pt"
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_payloads(tmp_path / "pwned")["builtins.open"], protocol=2))
    with pytest.raises(torch_lazy.UnsafeCheckpointError):
        torch_lazy.load(f)
    assert not (tmp_path / "pwned").exists()


def test_baton_convert_of_a_crafted_checkpoint_prints_the_refusal_in_one_line(tmp_path, baton_home, record_property):
    """An expected failure (a refused checkpoint) prints its one line, not a traceback of baton's own frames."""
    from conftest import baton

    record_property("fault", "crafted DCP .metadata handed to `baton convert`")
    target = tmp_path / "pwned"
    root = _dist_checkpoint(tmp_path / "ckpt")
    (root / ".metadata").write_bytes(pickle.dumps(_payloads(target)["os.system"]))
    r = baton("convert", str(root), str(tmp_path / "out"), "--from-format", "megatron-dist", home=baton_home,
              timeout=300)
    assert r.returncode != 0 and not target.exists() and not (tmp_path / "out").exists()
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and ".metadata: refers to" in lines[0] and lines[1].startswith("baton convert:"), r.stderr
