"""conversions/ollama.py: the Modelfile beside an exported GGUF file. A chat template is recognised only when it
renders the probe conversations exactly as a known family's turn format (ChatML, which the data stage writes; Gemma),
and then gets that family's Go template; any other template gets no Modelfile and a named reason."""
from __future__ import annotations

import pytest

from conversions import ollama

pytestmark = pytest.mark.fast

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma 3's own template, its system-prompt folding kept (the probes have no system message)
GEMMA = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] "
         "+ '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
         "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
         "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
         "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if "
         "loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
         "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# Qwen2.5's ChatML adds a system prompt of its own when the conversation has none: not the ChatML Go template's output
QWEN_DEFAULT_SYSTEM = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are a helpful "
                       "assistant.<|im_end|>\n' }}{%- endif %}" + CHATML)
LLAMA3 = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
          "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
          "<|end_header_id|>\n\n' }}{% endif %}")


@pytest.mark.parametrize("template, family", [(CHATML, "chatml"), (GEMMA, "gemma"), (QWEN_DEFAULT_SYSTEM, None),
                                              (LLAMA3, None), ("{{ raise_exception('no chat') }}", None)])
def test_a_template_is_recognised_only_when_it_renders_as_a_known_family(template, family):
    found = ollama.family_of(template, bos="<bos>", eos="<eos>")
    assert (found.name if found else None) == family


def test_the_modelfile_of_a_chatml_checkpoint_names_the_file_its_template_and_stops(hf_checkpoint):
    text, family = ollama.modelfile(hf_checkpoint, "model.gguf")
    assert family == "chatml"
    assert text.splitlines()[0] == "FROM ./model.gguf"
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n' in text
    assert text.splitlines()[-1] == 'PARAMETER stop "<|im_end|>"' and text.count("PARAMETER stop") == 1


def test_a_checkpoint_of_an_unknown_template_family_gets_no_modelfile_and_a_reason(hf_checkpoint, tmp_path):
    import shutil

    src = shutil.copytree(hf_checkpoint, tmp_path / "src")
    (src / "chat_template.jinja").write_text(LLAMA3)
    text, why = ollama.modelfile(src, "model.gguf")
    assert text is None
    assert why == "no Modelfile: the chat template renders as none of the known families (chatml, gemma)"
