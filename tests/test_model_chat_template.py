"""`model.chat_template`: a template for an HF checkpoint that has none. Checked when the config loads (it must parse
as Jinja and render a conversation), named as the fix when a template-less model is refused, and written into the
tokenizer of the data stage and of the checkpoints the chat stages write (through data → rlhf → finetune → convert
for a template-less model: tests/test_own_model_and_data.py, its Llama case)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY
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
@pytest.mark.reliability
@pytest.mark.parametrize("content", ["root:$6$saltsalt$secrethash:19000:0:99999:7:::\n",  # renders as itself
                                     "{% if %}root:$6$saltsalt$secrethash{% endif %}",  # a syntax error
                                     "{{ raise_exception('root:$6$saltsalt$secrethash') }}",  # a render error
                                     b"\x89PNG root:$6$saltsalt$secrethash"])  # not UTF-8
def test_a_file_named_as_the_template_is_never_echoed(tmp_path, content, record_property):
    """model.chat_template may name any file the user can read: its refusal says why, never what the file holds."""
    record_property("fault", "model.chat_template naming a secret file")
    path = tmp_path / "shadow"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = refusal(str(path))
    assert "secrethash" not in line and "root:" not in line and "PNG" not in line, line


@pytest.mark.fast
def test_a_template_file_is_read_and_its_contents_fingerprinted(tmp_path):
    from flows import chain_planner

    path = tmp_path / "zephyr.jinja"
    path.write_text(ZEPHYR)
    cfg = load(TINY, [f"model.chat_template={path}"], stages=["finetune"])
    before = chain_planner.plan(cfg, "hf-safetensors", "input-fp")
    path.write_text(ZEPHYR.replace("<|assistant|>", "<|bot|>"))
    after = chain_planner.plan(cfg, "hf-safetensors", "input-fp")
    by_label = {s.label: s.fingerprint for s in after}
    assert before[0].fingerprint != by_label["data"]  # the data stage writes it into the model's tokenizer
    assert next(s for s in before if s.name == "finetune").fingerprint != by_label["finetune"]
    path.write_text("{{ messages[0]['content'] }}")
    assert "renders a conversation without its user" in refusal(str(path))


@pytest.mark.fast
def test_a_template_less_model_is_refused_naming_the_key_and_passes_with_it(tmp_path):
    from flows import chain_planner
    from flows.pipeline import check_chat_template

    ckpt = tmp_path / "base"
    ckpt.mkdir()
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg = load(TINY, stages=["data", "finetune"])
    steps = chain_planner.plan(cfg, "hf-safetensors", "fp")
    with pytest.raises(ConfigError) as e:
        check_chat_template(cfg, steps, ckpt, "hf-safetensors")
    assert "has no chat template" in str(e.value) and "set model.chat_template" in str(e.value), e.value
    cfg = load(TINY, [f"model.chat_template={json.dumps(ZEPHYR)}"], stages=["data", "finetune"])
    check_chat_template(cfg, chain_planner.plan(cfg, "hf-safetensors", "fp"), ckpt, "hf-safetensors")


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
