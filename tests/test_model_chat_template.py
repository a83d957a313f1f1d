"""`model.chat_template`: a template for an HF checkpoint that has none. Checked when the config loads (it must parse
as Jinja and render a conversation), named as the fix when a template-less model is refused, and written into the
tokenizer of the data stage and of the checkpoints the chat stages write."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, baton, cli
from flows.config import ConfigError, load

ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def strip_template(ckpt: Path) -> Path:
    """The checkpoint as a base model ships: a tokenizer without any chat template."""
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return ckpt


def refusal(value: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(TINY, [f"model.chat_template={json.dumps(value)}"])
    (line,) = [ln for ln in str(e.value).splitlines() if "model.chat_template" in ln]
    return line


@pytest.mark.fast
@pytest.mark.parametrize("value, expected", [
    ("{% for m in messages %}{{ m['content'] }}", "does not parse as Jinja (template line 1)"),
    ("{{ messages[0]['content'] }}", "renders a conversation without its user and assistant message"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("missing/template.jinja", "neither a Jinja template"),
    ("  ", "neither a Jinja template"),
])
def test_a_bad_template_is_refused_when_the_config_loads(value, expected):
    line = refusal(value)
    assert line.strip().startswith("model.chat_template:") and expected in line, line


@pytest.mark.fast
def test_a_template_file_is_read_and_its_contents_fingerprinted(tmp_path):
    from flows import plan

    path = tmp_path / "zephyr.jinja"
    path.write_text(ZEPHYR)
    cfg = load(TINY, [f"model.chat_template={path}"], stages=["finetune"])
    before = plan.plan(cfg, "hf-safetensors", "input-fp")
    path.write_text(ZEPHYR.replace("<|assistant|>", "<|bot|>"))
    after = plan.plan(cfg, "hf-safetensors", "input-fp")
    by_label = {s.label: s.fingerprint for s in after}
    assert before[0].fingerprint != by_label["data"]  # the data stage writes it into the model's tokenizer
    assert next(s for s in before if s.name == "finetune").fingerprint != by_label["finetune"]
    path.write_text("{{ messages[0]['content'] }}")
    assert "renders a conversation without its user" in refusal(str(path))


@pytest.mark.fast
def test_a_template_less_model_is_refused_naming_the_key_and_passes_with_it(tmp_path):
    from flows import plan
    from flows.pipeline import check_chat_template

    ckpt = tmp_path / "base"
    ckpt.mkdir()
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg = load(TINY, stages=["data", "finetune"])
    steps = plan.plan(cfg, "hf-safetensors", "fp")
    with pytest.raises(ConfigError) as e:
        check_chat_template(cfg, steps, ckpt, "hf-safetensors")
    assert "has no chat template" in str(e.value) and "set model.chat_template" in str(e.value), e.value
    cfg = load(TINY, [f"model.chat_template={json.dumps(ZEPHYR)}"], stages=["data", "finetune"])
    check_chat_template(cfg, plan.plan(cfg, "hf-safetensors", "fp"), ckpt, "hf-safetensors")


@pytest.mark.fast
def test_the_template_is_written_only_where_none_is(tmp_path):
    from conversions import hf, manifest as mf
    from tasks import chat_template

    src, own = tmp_path / "src", tmp_path / "own"
    for d in (src, own):
        d.mkdir()
        (d / "tokenizer_config.json").write_text("{}")
    (own / "chat_template.jinja").write_text("{{ 'own' }}")
    template = tmp_path / "t.jinja"
    template.write_text(ZEPHYR)
    hf.copy_tokenizer(src, tmp_path / "a", chat_template=template)
    hf.copy_tokenizer(own, tmp_path / "b", chat_template=template)
    assert (tmp_path / "a" / "chat_template.jinja").read_text() == ZEPHYR and mf.chat_template_present(tmp_path / "a")
    assert (tmp_path / "b" / "chat_template.jinja").read_text() == "{{ 'own' }}"
    assert chat_template.write_if_missing(ZEPHYR, own) is None
    assert chat_template.resolved({"chat_template": str(template)})["chat_template"] == ZEPHYR


@pytest.mark.slow
@pytest.mark.parametrize("stage, output_label", [("finetune", "convert-zero-to-hf"), ("rlhf", "rlhf")])
def test_the_key_takes_a_template_less_model_through_data_and_a_chat_stage(tmp_path, baton_home, stage,
                                                                             output_label):
    """data (the model's tokenizer + the configured template) → finetune (DeepSpeed) → HF, or → rlhf (TRL DPO): the
    stage renders the conversations with the template, and every tokenizer on the way carries it."""
    from test_own_model_and_data import own_model, write_files

    files = write_files(tmp_path / "data")
    texts = [json.dumps(json.loads(line)) for line in files["sft"].read_text().splitlines()]
    ckpt = strip_template(own_model(tmp_path / "llama", "llama", texts))
    assert cli("manifest", str(ckpt), home=baton_home).returncode == 0
    template = tmp_path / "zephyr.jinja"
    template.write_text(ZEPHYR)
    cfg = tmp_path / "own.yaml"
    cfg.write_text(f"""
name: own-template
stages: [data, {stage}]
model: {{chat_template: "{template}"}}
data:
  pretrain: {{kind: files, train: "{files['corpus']}"}}
  sft: {{kind: files, train: "{files['sft']}"}}
  preference: {{kind: files, train: "{files['pref']}"}}
rlhf: {{steps: 12, micro_batch_size: 8, lr: 1.0e-3}}
finetune: {{nproc_per_node: 1, steps: 12, micro_batch_size: 8, lr: 3.0e-3, checkpoint_every: 12}}
tracking: {{experiment: own, registered_model: own-template}}
""")
    r = baton("run", str(cfg), "--from", str(ckpt), home=baton_home, timeout=1800)
    run_dir = baton_home / "runs" / r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1] if r.stdout.strip() else None
    summary = json.loads((run_dir / "summary.json").read_text()) if run_dir else {}
    assert r.returncode == 0, (r.stderr[-3000:], json.dumps(summary, indent=1)[-3000:])
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages)[0] == "data" and output_label in stages
    data_tok = Path(stages["data"]["output"]) / "tokenizer"
    assert (data_tok / "chat_template.jinja").read_text() == ZEPHYR
    assert stages[stage]["gate"]["passed"], stages[stage]["gate"]
    out = Path(stages[output_label]["output"])
    assert (out / "chat_template.jinja").read_text() == ZEPHYR
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|user|>\nhi</s>\n<|assistant|>\n"
    assert not (ckpt / "chat_template.jinja").exists()  # the input checkpoint is never written to
