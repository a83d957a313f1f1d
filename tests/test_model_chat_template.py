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


# ---- the template's end-of-turn token is a stop token of what the stages write ---------------------------------
GEMMA = TINY.parent / "real-gemma3.yaml"  # Gemma's turn format, given to a base model that has none


def gemma_base(dest: Path) -> Path:
    """A Gemma 3 base model as it ships: no chat template; its eos is <eos>, its turn markers are special tokens."""
    from test_own_model_and_data import own_model, write_files

    files = write_files(dest / "files")
    texts = [json.dumps(json.loads(line)) for line in files["sft"].read_text().splitlines()]
    return own_model(dest / "gemma3", "gemma3", texts)


def finetune_prepared(base: Path, work: Path, cfg):
    """The finetune stage's output folder as it stands before training: what the stage wrote around the input's
    tokenizer and configs (training only adds the weights)."""
    from conversions import manifest as mf
    from tasks import chat_template
    from tasks.finetune import task
    from tasks.stage import StageContext

    data = work / "data"
    (data / "sft").mkdir(parents=True)
    for split in ("train", "heldout"):
        (data / "sft" / f"{split}.jsonl").write_text("")
    mf.write(base, mf.build(base, format="hf-safetensors", stage="import", parameter_count=1, dtype="float32"))
    ctx = StageContext(stage="finetune", run_id="test", run_dir=work, work_dir=work / "finetune", seed=0,
                       model=chat_template.resolved(cfg.model.model_dump()), data_dir=data, input=base,
                       input_format="hf-safetensors")
    _, _, out, _ = task.prepare(ctx, cfg.finetune)
    mf.write(out, mf.build(out, format="deepspeed-zero", stage="finetune", parameter_count=1, dtype="float32",
                           parent=mf.parent_ref(base), tokenizer_dir=out / "tokenizer"))
    return out


@pytest.mark.fast
def test_the_templates_end_of_turn_token_becomes_a_stop_token_the_gate_accepts_as_asked(tmp_path):
    """Gemma's template closes a reply with <end_of_turn>, which is not the base model's eos: the stage that writes the
    template makes it a stop token (generation_config.json's eos_token_id, which vLLM and SGLang stop at), and the
    serving-contract gate reports the change as the config's."""
    from transformers import AutoTokenizer

    from conversions import manifest as mf
    from tasks import chat
    from flows.step_gate import END_OF_TURN, serving_contract_check

    base = strip_template(gemma_base(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(base))
    eos, end_of_turn = tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")
    cfg = load(GEMMA)
    tok.chat_template = cfg.model.chat_template
    assert chat.end_of_turn_id(tok) == end_of_turn != eos

    out = finetune_prepared(base, tmp_path, cfg)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eos, end_of_turn]
    assert mf.read(out)["serving"]["stop_token_ids"] == sorted([eos, end_of_turn])
    assert json.loads((base / "generation_config.json").read_text())["eos_token_id"] == eos  # the input is untouched
    check = serving_contract_check(out, cfg)
    assert check["passed"] and f"stop_token_ids: [{eos}] → {sorted([eos, end_of_turn])} ({END_OF_TURN})" in \
        check["detail"], check
    unasked = serving_contract_check(out, load(TINY))  # the same stops, with no template in the config: drift
    assert not unasked["passed"] and "stop_token_ids" in unasked["detail"], unasked


@pytest.mark.fast
@pytest.mark.parametrize("template", [
    ZEPHYR,  # the reply is closed by the eos: a stop token already
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}",  # by plain text: no token
])
def test_a_template_whose_turn_ends_in_no_new_special_token_leaves_the_stops_as_they_were(tmp_path, template):
    from tasks import chat

    base = strip_template(gemma_base(tmp_path))
    (base / "chat_template.jinja").write_text(template)
    before = (base / "generation_config.json").read_bytes()
    assert chat.add_end_of_turn_stop(base) is None
    assert (base / "generation_config.json").read_bytes() == before
