"""The streaming ZeRO → HF converter on its own: bit for bit against DeepSpeed on a ZeRO-1 checkpoint of a model
whose shapes force group padding, its lazy reader and shard writer, its failures, and the stage's config checks."""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import TINY, make_hf_checkpoint
from conversions import hf, manifest as mf, safetensors_stream, torch_lazy, verify, zero
from tasks.finetune.config import FinetuneConfig, validate

# hidden 30: the no-decay group (norms) holds 30 * 5 elements, not a multiple of 2 * world_size, so ZeRO-1/2 pad it
ODD_ARCH = {"num_layers": 2, "hidden_size": 30, "num_attention_heads": 3, "num_query_groups": 1, "ffn_hidden_size": 70}


@pytest.fixture(scope="module")
def zero1_checkpoint(tmp_path_factory, tiny_config, data_dir):
    from tasks.finetune.task import run_finetune
    from tasks.stage import StageContext

    arch = tiny_config.model.model_dump() | ODD_ARCH
    src = make_hf_checkpoint(tmp_path_factory.mktemp("odd") / "hf", arch, data_dir / "tokenizer", seed=1)
    mf.write(src, mf.build(src, format="hf-safetensors", stage="external", dtype="float32", architecture=arch))
    work = tmp_path_factory.mktemp("zero1")
    ctx = StageContext(stage="finetune", run_id="test", run_dir=work, work_dir=work, model=arch, seed=0,
                       data_dir=data_dir, input=src, input_format="hf-safetensors")
    cfg = FinetuneConfig(zero={"stage": 1}, steps=3, warmup_steps=1, checkpoint_every=3, weight_decay=0.1,
                         launcher="torchrun", timeout_s=900)
    return run_finetune.fn(ctx, cfg).output


def test_zero1_matches_deepspeed_bit_for_bit(zero1_checkpoint, tmp_path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    ck = zero.open_checkpoint(zero1_checkpoint)
    assert ck.stage == 1 and ck.world_size == 2 and len(ck.param_shapes) == 2
    info = zero.to_hf(zero1_checkpoint, tmp_path / "ours", max_shard_bytes=40_000)  # forces several shards
    assert info["shards"] > 1 and (tmp_path / "ours" / safetensors_stream.INDEX_NAME).exists()
    convert_zero_checkpoint_to_state_dict(str(zero1_checkpoint), str(tmp_path / "ds"), safe_serialization=True)
    ours, theirs = hf.load_state_dict(tmp_path / "ours"), hf.load_state_dict(tmp_path / "ds")
    assert ours and ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    # a complete HF folder that transformers loads with no missing or unexpected keys
    checks = verify.preflight(tmp_path / "ours") + verify.roundtrip(tmp_path / "ours")
    assert checks and all(c["passed"] for c in checks), checks


def test_bf16_output_is_the_cast_of_the_fp32_master_weights(zero1_checkpoint, tmp_path):
    zero.to_hf(zero1_checkpoint, tmp_path / "fp32", max_shard_bytes=1 << 30)
    info = zero.to_hf(zero1_checkpoint, tmp_path / "bf16", max_shard_bytes=1 << 30, dtype="bfloat16")
    assert info["dtype"] == "bfloat16" and hf.dominant_dtype(tmp_path / "bf16") == "bfloat16"
    full, half = hf.load_state_dict(tmp_path / "fp32"), hf.load_state_dict(tmp_path / "bf16")
    assert full and full.keys() == half.keys()
    assert all(torch.equal(full[k].to(torch.bfloat16), half[k]) for k in full)


def test_lazy_reader_equals_torch_load(zero1_checkpoint):
    f = next((zero1_checkpoint / zero.resolve_tag(zero1_checkpoint)).glob("*optim_states.pt"))
    real = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    lazy = torch_lazy.load(f)["optimizer_state_dict"]
    for a, b in zip(real["single_partition_of_fp32_groups"], lazy["single_partition_of_fp32_groups"]):
        assert torch.equal(a, b.load())
    part = lazy["single_partition_of_fp32_groups"][0]
    window = torch.empty(7, dtype=part.dtype)
    part.read_flat_into(window, 5, 7)  # a byte range, nothing else read
    assert torch.equal(window, real["single_partition_of_fp32_groups"][0][5:12])


def test_missing_rank_file_is_a_clear_error(zero1_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(zero1_checkpoint, broken)
    tag_dir = broken / zero.resolve_tag(broken)
    next(tag_dir.glob("zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(zero.ZeroCheckpointError, match="partition_count 2 but 1 optimizer files"):
        zero.to_hf(broken, tmp_path / "out", max_shard_bytes=1 << 30)


def test_flipped_byte_in_a_partition_is_caught_by_the_manifest(zero1_checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(zero1_checkpoint, copy)
    assert verify.report(verify.integrity(copy))["passed"]
    f = next((copy / zero.resolve_tag(copy)).glob("zero_pp_rank_0_*optim_states.pt"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    rep = verify.report(verify.integrity(copy))
    assert not rep["passed"] and "sha256 mismatch" in rep["checks"][0]["detail"]


def test_verify_fits_a_zero_checkpoint(zero1_checkpoint):
    rep = verify.verify(zero1_checkpoint)
    assert rep["passed"], verify.format_report(rep)
    assert [c["name"] for c in rep["checks"]][-1] == "L1.reload" and not any("preflight" in c["name"]
                                                                               for c in rep["checks"])


def test_stream_writer_round_trip(tmp_path):
    tensors = {"b": torch.arange(10, dtype=torch.int64), "a": torch.randn(3, 5), "c": torch.randn(4).bfloat16(),
               "s": torch.tensor(2.5)}
    plan = [safetensors_stream.PlannedTensor(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()]
    files = safetensors_stream.write(tmp_path, plan, max_shard_bytes=64)
    assert len(files) > 1
    back = hf.load_state_dict(tmp_path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert all(hf.read_header(f)["__metadata__"] == {"format": "pt"} for f in files)


@pytest.mark.parametrize("overrides, message", [
    (["finetune.zero.stage=4"], "finetune.zero.stage: 4 is not a ZeRO stage"),
    (["finetune.zero.stage=2", "finetune.zero.offload_params=cpu"], "parameter offload needs ZeRO stage 3"),
    (["finetune.micro_batch_size=0"], "finetune.micro_batch_size: Input should be greater than or equal to 1"),
    (["finetune.steps=10", "finetune.warmup_steps=10"], "leaves no steps for the cosine schedule"),
])
def test_bad_configs_fail_before_launch(overrides, message):
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(TINY, overrides, stages=["data", "finetune"])
    assert message in str(e.value)
    assert validate(FinetuneConfig()) == []
