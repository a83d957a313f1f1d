"""Training tokenizes a conversation as a server does: the whole rendering at once. A plain-text chat template has no
special token between turns to cut BPE merges, so tokenizing it turn by turn gives other ids than the engine's
tokenization of the rendered history; ChatML and Gemma templates give the same ids either way. The expectation is the
tokenizer's own `apply_chat_template(..., tokenize=True)`, which is what vLLM's /tokenize does with the messages
(tasks.chat is not asked). Pure: no engine."""
from __future__ import annotations

import json

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

# `[USER] …` / `[BOT] …` turns on one line, each closed by a space: no special token anywhere, and the space that
# ends a turn merges with the next turn's '[' (' [' is the vocabulary's most frequent pair). The generation prompt
# ends at `[BOT]` and a reply is rendered as ' ' + content, so the engine's prompt ends on a token boundary.
PLAIN = ("{% for m in messages %}{{ '[BOT]' if m['role'] == 'assistant' else '[' + m['role'] | upper + ']' }} "
         "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}[BOT]{% endif %}")
# The same turns with the space after `[BOT]` in the generation prompt: a served prompt ends with ' ', which the
# conversation merges into the reply's first token (' A').
PLAIN_SPACE = ("{% for m in messages %}{{ '[BOT] ' if m['role'] == 'assistant' else '[' + m['role'] | upper + '] ' }}"
               "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}[BOT] {% endif %}")
CONVERSATION = [{"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": "What color is a kiwi?"}, {"role": "assistant", "content": "A kiwi is brown."},
                {"role": "user", "content": "What color is a fig?"}, {"role": "assistant", "content": "A fig is purple."}]


def served(tok, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The engine's ids: the rendered messages tokenized at once, without added special tokens."""
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                   return_dict=True)["input_ids"]


def turn_by_turn(tok, messages: list[dict]) -> list[int]:
    """main's encoding before this change: each context and each reply piece of the rendering tokenized alone."""
    full = tok.apply_chat_template(messages, tokenize=False)
    cuts = [0]
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            cuts += [len(tok.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)),
                     len(tok.apply_chat_template(messages[:i + 1], tokenize=False))]
    pieces = [full[a:b] for a, b in zip(cuts, cuts[1:] + [len(full)]) if b > a]
    return [t for piece in pieces for t in tok(piece, add_special_tokens=False)["input_ids"]]


def rendered_rows(template: str) -> list[str]:
    """The own model's SFT conversations (tests/test_own_model_and_data.py) rendered with the template: a user's own
    BPE trained on their chat text learns merges across turn boundaries (' [', ' A')."""
    import tempfile
    from pathlib import Path

    from transformers.utils.chat_template_utils import render_jinja_template

    from test_own_model_and_data import write_files

    files = write_files(Path(tempfile.mkdtemp()) / "files")
    rows = [json.loads(line)["messages"] for line in files["sft"].read_text().splitlines()]
    return [render_jinja_template([r], chat_template=template, bos_token="<s>", eos_token="</s>")[0][0] for r in rows]


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    from test_own_model_and_data import own_tokenizer

    return own_tokenizer(tmp_path_factory.mktemp("plain"), rendered_rows(PLAIN), template=PLAIN)


def test_a_plain_text_template_trains_on_the_ids_the_engine_tokenizes(plain_tok):
    from tasks import chat

    tok = plain_tok
    whole = served(tok, CONVERSATION)
    assert turn_by_turn(tok, CONVERSATION) != whole  # merges cross the turns: the old encoding was not the served one
    e = chat.encode(tok, CONVERSATION, 512)
    assert e.ids == whole
    learned = tok.decode([t for t, lab in zip(e.ids, e.labels) if lab != chat.IGNORE])
    assert learned == " A kiwi is brown. [ A fig is purple. "  # each reply, and the token that starts in its space
    # every reply's context is, token for token, the engine's prompt for that turn
    for k in (2, 4):
        prompt = served(tok, CONVERSATION[:k], generation_prompt=True)
        assert e.ids[:len(prompt)] == prompt and e.labels[len(prompt) - 1] == chat.IGNORE != e.labels[len(prompt)]


def test_the_serve_checks_training_side_is_the_engines_prompt_where_turn_by_turn_was_not(plain_tok):
    """smoke.chat_template_parity compares vLLM's /tokenize with chat.reply_context_ids: for the multi-turn
    conversation the turn-by-turn ids differed (the check refused the model), the one-pass ids do not."""
    from tasks import chat
    from tasks.serve.smoke import CONVERSATIONS

    for name, messages in CONVERSATIONS.items():
        engine = served(plain_tok, messages, generation_prompt=True)
        assert chat.reply_context_ids(plain_tok, messages) == engine, name
    multi = CONVERSATIONS["multi-turn"]
    old = turn_by_turn(plain_tok, multi + [{"role": "assistant", "content": "reply"}])
    assert old[:len(served(plain_tok, multi, generation_prompt=True))] != served(plain_tok, multi, True)


@pytest.mark.parametrize("family", ["chatml", "gemma"])
def test_chatml_and_gemma_templates_give_the_ids_they_gave_before(tmp_path, family):
    """Their special tokens cut every merge at a turn boundary: one pass and turn by turn agree, and both are the
    engine's ids; the replies learned are the same as before."""
    from tasks import chat

    if family == "chatml":  # baton's own data-stage tokenizer and template
        from tasks.data.tokenizer import CHAT_TEMPLATE, train_tokenizer

        tok = train_tokenizer(rendered_rows(CHAT_TEMPLATE), 400, tmp_path)
        closing = "<|im_end|>"
    else:  # a Gemma vocabulary with configs/real-gemma3.yaml's template
        from flows.config import load
        from test_own_model_and_data import own_tokenizer

        template = load(REPO / "configs" / "real-gemma3.yaml").model.chat_template
        tok = own_tokenizer(tmp_path, rendered_rows(template), gemma=True)
        tok.chat_template = template
        closing = "<end_of_turn>"
    e = chat.encode(tok, CONVERSATION, 512)
    assert e.ids == served(tok, CONVERSATION) == turn_by_turn(tok, CONVERSATION)
    learned = tok.decode([t for t, lab in zip(e.ids, e.labels) if lab != chat.IGNORE])
    assert learned.startswith("A kiwi is brown." + closing) and f"A fig is purple.{closing}" in learned, learned


def test_a_generation_prompt_that_ends_inside_the_replys_token_is_refused_naming_the_fix(tmp_path):
    """`[BOT] ` + `A kiwi…`: a served prompt ends with the token ' ', the whole conversation tokenizes ' A' there, so
    no single sequence trains the reply after the context a server sends: the conversation is refused, not trained."""
    from tasks import chat
    from test_own_model_and_data import own_tokenizer

    tok = own_tokenizer(tmp_path, rendered_rows(PLAIN_SPACE), template=PLAIN_SPACE)
    prompt = served(tok, CONVERSATION[:2], generation_prompt=True)
    assert served(tok, CONVERSATION)[:len(prompt)] != prompt  # the fault is real: the engine's prompt is not a prefix
    with pytest.raises(chat.TemplateError, match=r"generation prompt does not end on a token boundary.*' A'"):
        chat.encode(tok, CONVERSATION, 512)
    with pytest.raises(chat.TemplateError, match="token boundary"):
        chat.completion(tok, CONVERSATION[:2], CONVERSATION[2:3])
    assert "token boundary" in chat.boundary_problem(tok, [CONVERSATION])


def test_such_a_template_is_refused_before_finetune_launches_naming_the_key(tmp_path):
    """The finetune stage's input check renders probe conversations and the data's first rows with the template the
    worker would use (here the config's `model.chat_template`) and refuses, in one line, before any launch."""
    from flows.config import load
    from tasks import chat_template
    from tasks.finetune import task
    from tasks.stage import StageContext
    from test_model_chat_template import strip_template
    from test_own_model_and_data import own_tokenizer

    base = tmp_path / "base"
    own_tokenizer(base, rendered_rows(PLAIN_SPACE), template=PLAIN_SPACE)
    strip_template(base)
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data" / "sft"
    data.mkdir(parents=True)
    for split in ("train", "heldout"):
        (data / f"{split}.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    cfg = load(REPO / "configs" / "tiny.yaml")

    def context(template: str) -> StageContext:
        return StageContext(stage="finetune", run_id="test", run_dir=tmp_path, work_dir=tmp_path / "finetune", seed=0,
                            model={**cfg.model.model_dump(), "chat_template": template}, data_dir=data.parent,
                            input=base, input_format="hf-safetensors")

    with pytest.raises(task.FinetuneInputError, match=r"^finetune: model\.chat_template: the chat template's "
                                                      r"generation prompt does not end on a token boundary"):
        task.check_inputs(context(PLAIN_SPACE), cfg.finetune)
    task.check_inputs(context(PLAIN), cfg.finetune)  # the blank-line template's prompt ends on a boundary: passes
