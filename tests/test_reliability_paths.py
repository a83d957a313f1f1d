"""Config paths are confined before anything launches (issue 12, item 8): names that become folder or file names stay
plain names, folders the run writes into cannot wander, and paths it only reads must exist as what they are meant to
be. Real files and real CLI processes; each refusal is one line naming the key."""
from __future__ import annotations

import pytest

from conftest import TINY, baton
from flows.config import ConfigError, load

pytestmark = [pytest.mark.fast, pytest.mark.reliability]


def refused(overrides: list[str], stages: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load(TINY, overrides, stages)
    return str(e.value)


@pytest.mark.parametrize("key", ["name", "tracking.registered_model"])
@pytest.mark.parametrize("bad", ["../..", "..", "a/b", "/etc/passwd", "x\\y", "", ".hidden"])
def test_names_that_build_paths_are_plain_names(key, bad, record_property):
    record_property("fault", "path escape in a config name")
    msg = refused([f"{key}={bad!r}" if bad else f"{key}=''"])
    assert f"  {key}: " in msg and "plain name" in msg


def test_plain_names_still_load(record_property):
    record_property("fault", "(control) plain names load")
    cfg = load(TINY, ["name=tiny-2.v1", "tracking.registered_model=baton_tiny-2"])
    assert cfg.name == "tiny-2.v1" and cfg.tracking.registered_model == "baton_tiny-2"


def test_a_nul_byte_is_refused_in_any_value(tmp_path, record_property):
    record_property("fault", "NUL byte in a config path")
    cfg = tmp_path / "nul.yaml"
    cfg.write_text('name: tiny\nserve:\n  served_model_name: "tiny\\0../../x"\n')
    with pytest.raises(ConfigError, match=r"serve\.served_model_name: contains a NUL byte"):
        load(cfg)
    with pytest.raises(ConfigError, match=r"--set data\.revision: not a YAML value"):
        load(TINY, ["data.revision=a\0b"])


def test_a_write_folder_cannot_wander(record_property):
    record_property("fault", "path escape in a write folder")
    msg = refused(["finetune.zero.stage=3", "finetune.zero.offload_params=nvme", "finetune.zero.offload_optimizer=cpu",
                   "finetune.zero.nvme_path=/tmp/swap/../../etc"], ["finetune"])
    assert "finetune.zero.nvme_path: '/tmp/swap/../../etc' contains '..'" in msg


def test_read_paths_may_be_anywhere_but_must_exist(tmp_path, record_property):
    record_property("fault", "missing or wrong-kind read path")
    rows = tmp_path / "elsewhere" / "sft.jsonl"
    rows.parent.mkdir()
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    ok = load(TINY, ["data.sft.kind=files", f"data.sft.train={rows}"], ["data"])  # outside the checkout: fine
    assert ok.data.sft.train == str(rows)
    assert "data.sft.train: " in refused(["data.sft.kind=files", f"data.sft.train={tmp_path}/none/*.jsonl"], ["data"])
    assert "data.pretrain.heldout: " in refused(["data.pretrain.kind=files", f"data.pretrain.train={rows}",
                                                 f"data.pretrain.heldout={tmp_path}/nothing.txt"], ["data"])
    assert f"serve.lm_eval.include_path: {rows} is not a folder" in refused(
        [f"serve.lm_eval.include_path={rows}"], ["serve"])
    assert f"runtimes.main.python: {tmp_path} is not a regular file" in refused([f"runtimes.main.python={tmp_path}"])
    assert f"runtimes.nemo_rl.path: {tmp_path}/gone: no such folder" in refused(
        [f"runtimes.nemo_rl.path={tmp_path}/gone"])
    # a cluster runtime's python lives on its nodes: not checked here
    load(TINY, ["runtimes.main.kind=slurm", "runtimes.main.python=/shared/venv/bin/python"], ["data"])


def test_the_cli_refuses_before_writing_anything(tmp_path, record_property):
    record_property("fault", "path escape in a config name")
    home = tmp_path / "home"
    r = baton("run", str(TINY), "--stages", "data", "--set", "name=../../escape", home=home, timeout=120)
    assert r.returncode == 2 and "name: " in r.stderr and "plain name" in r.stderr
    assert not (home / "runs").exists() and not (tmp_path / "escape").exists()
    not_a_folder = tmp_path / "weights.bin"
    not_a_folder.write_bytes(b"x")
    r = baton("run", str(TINY), "--stages", "finetune", "--from", str(not_a_folder), home=home, timeout=120)
    assert r.returncode == 2 and f"--from {not_a_folder}: not a folder" in r.stderr


@pytest.mark.parametrize("flags", ['["--host", "0.0.0.0"]', '["--port", "9", "--host=0.0.0.0"]'])
def test_engine_args_cannot_reopen_the_server_to_other_machines(flags, record_property):
    """Extra engine flags come last on the command line: a --host there would override serve.host past allow_remote."""
    record_property("fault", "--host in serve.engine_args")
    msg = refused([f"serve.engine_args.vllm={flags}"])
    assert "serve.engine_args.vllm: --host is set by serve.host" in msg, msg


@pytest.mark.parametrize("flags, flag", [('["--port", "80"]', "--port"), ('["--trust_remote_code"]', "--trust-remote-code"),
                                         ('["--trust-remote"]', "--trust-remote-code"), ('["--config=x.yaml"]', "--config"),
                                         ('["--uds", "/tmp/s"]', "--uds")])
def test_engine_args_cannot_move_the_server_or_run_the_checkpoint_s_code(flags, flag, record_property):
    """A --port, a --trust-remote-code (spelt with '_' or abbreviated as argparse allows) or an option file in the
    extra flags would undo what baton sets and checks."""
    record_property("fault", "launch-shaping flag in serve.engine_args")
    msg = refused([f"serve.engine_args.sglang={flags}"])
    assert f"serve.engine_args.sglang: {flag} " in msg and "not by extra flags" in msg, msg
    assert load(TINY, ['serve.engine_args.sglang=["--port-retries", "2", "--context-length", "64"]'])


@pytest.mark.parametrize("key", ["sbatch_args", "srun_args"])
def test_a_newline_cannot_inject_a_line_into_the_job_script(key, record_property):
    record_property("fault", "newline in a Slurm argument")
    msg = refused([f'runtimes.pretrain.{key}=["--partition=cpu\\nrm -rf /"]'])
    assert f"runtimes.pretrain.{key}" in msg and "control character" in msg, msg
    cfg = load(TINY, [f'runtimes.pretrain.{key}=["--partition=cpu"]'])  # an ordinary flag still loads
    assert cfg.runtimes["pretrain"].model_dump()[key] == ["--partition=cpu"]


def test_a_config_nested_thousands_deep_is_one_clear_refusal(tmp_path, record_property):
    record_property("fault", "YAML nested 20,000 deep")
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: tiny\nserve:\n  engine_args:\n    vllm: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: nested too deeply to be a config"):
        load(deep)
    with pytest.raises(ConfigError, match=r"--set data\.revision: nested too deeply"):
        load(TINY, ["data.revision=" + "[" * 20000 + "]" * 20000])
