"""Your own model and your own data, as a new user would bring them: an HF causal LM that baton did not make (Qwen2
with q/k/v biases, GQA and tied embeddings, Llama untied, or a Gemma 3 base model with sliding-window layers and no
chat template of its own; random weights, its own locally trained tokenizer and a chat template unlike baton's) and
files in the field's formats → data → rlhf (TRL DPO) → finetune (DeepSpeed) → convert (Qwen2 and Gemma 3 on to
vLLM), every gate on held-out loss. Bad input fails in the data stage, before any engine, naming file, line, field."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import baton, cli

# Zephyr-style turns closed by </s>: not baton's ChatML, so nothing can lean on baton's own template
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
# Gemma's vocabulary: its turn markers are special tokens, and <end_of_turn> is not its eos
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
FRUIT = {"banana": "yellow", "apple": "red", "lime": "green", "plum": "purple", "orange": "orange", "kiwi": "brown",
         "cherry": "red", "lemon": "yellow", "grape": "green", "fig": "purple"}


def own_tokenizer(dest: Path, texts: list[str], gemma: bool = False, template: str = TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = GEMMA_SPECIAL if gemma else SPECIAL
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if gemma:  # a base model: no chat template of its own
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                       additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        fast.chat_template = template
    fast.save_pretrained(str(dest))
    return fast


def own_model(dest: Path, family: str, texts: list[str], hidden: int = 64, template: str = TEMPLATE) -> Path:
    """A random-init HF model from its config, saved as any HF user would (no baton manifest)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = own_tokenizer(dest, texts, gemma=family == "gemma3", template=template)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    elif family == "gemma3":
        model = gemma3_model(common)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    model.save_pretrained(str(dest), safe_serialization=True)
    return dest


def gemma3_model(common: dict):
    """Gemma 3's text model: head_dim 32 (vLLM's CPU attention has no 16), a sliding-window layer then a global one
    (the window shorter than the chat prompts, so it matters), tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**common, head_dim=32, sliding_window=32,
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    config.architectures = ["Gemma3ForCausalLM"]
    return Gemma3ForCausalLM(config)


def qa(fruit: str) -> tuple[str, str]:
    return f"What color is a {fruit}?", f"A {fruit} is {FRUIT[fruit]}."


def write_files(root: Path) -> dict[str, Path]:
    """Pretraining markdown, multi-turn `messages` SFT with a system prompt, HH-style implicit-prompt preferences."""
    rng = random.Random(0)
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "fruit.md").write_text("\n\n".join(f"# {f}\nA {f} is {c}." for f, c in FRUIT.items()))
    sft, pref = [], []
    for _ in range(48):
        a, b = rng.sample(sorted(FRUIT), 2)
        (qa_, aa), (qb, ab) = qa(a), qa(b)
        sft.append({"messages": [{"role": "system", "content": "Answer in one sentence."},
                                 {"role": "user", "content": qa_}, {"role": "assistant", "content": aa},
                                 {"role": "user", "content": qb}, {"role": "assistant", "content": ab}]})
        wrong = rng.choice([c for c in set(FRUIT.values()) if c != FRUIT[a]])
        convo = [{"role": "user", "content": qa_}]
        pref.append({"chosen": convo + [{"role": "assistant", "content": aa}],
                     "rejected": convo + [{"role": "assistant", "content": f"A {a} is {wrong}."}]})
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (root / "pref.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pref))
    return {"corpus": root / "corpus", "sft": root / "sft.jsonl", "pref": root / "pref.jsonl"}


def write_config(path: Path, files: dict[str, Path], chat_template: Path | None = None) -> Path:
    template = f", chat_template: \"{chat_template}\"" if chat_template else ""
    path.write_text(f"""
name: own
stages: [data, rlhf, finetune]
model: {{num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2, ffn_hidden_size: 128,
        seq_length: 256, vocab_size: 512{template}}}
data:
  pretrain: {{kind: files, train: "{files['corpus']}"}}
  sft: {{kind: files, train: "{files['sft']}"}}
  preference: {{kind: files, train: "{files['pref']}"}}
rlhf: {{steps: 12, micro_batch_size: 8, lr: 1.0e-3}}
finetune: {{nproc_per_node: 1, steps: 12, micro_batch_size: 8, lr: 3.0e-3, checkpoint_every: 12}}
tracking: {{experiment: own, registered_model: own-model}}
""")
    return path


def summary_of(home: Path, stdout: str) -> dict:
    return json.loads((home / "runs" / stdout.strip().splitlines()[-1].rsplit("/", 1)[-1] / "summary.json").read_text())


@pytest.fixture
def workspace(tmp_path, baton_home):
    files = write_files(tmp_path / "data")
    texts = [json.dumps(json.loads(line)) for line in files["sft"].read_text().splitlines()]
    return tmp_path, files, texts


# Qwen2 and Gemma 3 go on to vLLM (head_dim 32: vLLM's CPU attention has no 16); Llama stops at the HF checkpoint
ON_VLLM = ["--stages", "data,rlhf,finetune,serve", "--set", "serve.engine=vllm", "--set", "serve.smoke.json_requests=4"]
SERVED = {"qwen2": ON_VLLM, "gemma3": ON_VLLM, "llama": []}
# Llama and Gemma 3 come as base models ship, without a chat template: the config's `model.chat_template` supplies it
# (Llama's closes a turn with its eos; Gemma's turn format, configs/real-gemma3.yaml's, with <end_of_turn>)
TEMPLATE_FROM_CONFIG = {"llama": "zephyr", "gemma3": "gemma"}


def configured_template(name: str) -> str:
    if name == "zephyr":
        return TEMPLATE
    from conftest import REPO
    from flows.config import load

    return load(REPO / "configs" / "real-gemma3.yaml").model.chat_template


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.parametrize("family", [pytest.param("qwen2", marks=pytest.mark.long), "llama",  # qwen2 serves: ~170 s
                                    # gemma3 serves too: 216 to 371 s (serve ~160 s): the 300 s default is short
                                    pytest.param("gemma3", marks=[pytest.mark.long, pytest.mark.timeout(900)])])
def test_own_model_and_files_through_rlhf_finetune_convert(workspace, baton_home, family):
    tmp_path, files, texts = workspace
    ckpt = own_model(tmp_path / family, family, texts, hidden=128 if SERVED[family] else 64)
    template = None
    if family in TEMPLATE_FROM_CONFIG:
        from test_model_chat_template import strip_template

        strip_template(ckpt)
        template = tmp_path / f"{TEMPLATE_FROM_CONFIG[family]}.jinja"
        template.write_text(configured_template(TEMPLATE_FROM_CONFIG[family]))
    r = cli("manifest", str(ckpt), home=baton_home)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = write_config(tmp_path / "own.yaml", files, chat_template=template)
    r = baton("run", str(cfg), "--from", str(ckpt), *SERVED[family], home=baton_home, timeout=3000)
    summary = summary_of(baton_home, r.stdout)
    assert r.returncode == 0, (r.stderr[-3000:], json.dumps(summary, indent=1)[-4000:])
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "rlhf", "finetune", "convert-zero-to-hf"] + (["serve"] if SERVED[family] else [])
    if SERVED[family]:
        assert stages["serve"]["status"] == "completed" and stages["serve"]["gate"]["passed"], stages["serve"]["gate"]
    data = stages["data"]
    assert data["formats"] == {"pretrain": "text", "preference": "implicit_preference", "sft": "messages"}
    assert data["tokenizer"].startswith("model:")  # the checkpoint's own tokenizer, no new BPE
    for label in ("rlhf", "finetune"):
        ev = stages[label]["eval"]
        print(f"{family} {label}: {ev} in {stages[label].get('seconds')} s")
        assert stages[label]["gate"]["passed"] and ev["metric"] == "heldout_loss" and ev["after"] < ev["before"], ev
    conv = stages["convert-zero-to-hf"]
    assert conv["gate"]["passed"], conv["gate"]
    out = Path(conv["output"])
    config = json.loads((out / "config.json").read_text())
    from conversions import hf

    names = {n for n, _ in hf.iter_tensors(out)}
    if family in ("qwen2", "gemma3"):  # tied embeddings
        tied = next(c for c in conv["gate"]["checks"] if c["name"] == "preflight.tied_embeddings")
        assert tied["passed"] and "equals" in tied["detail"], tied  # a shared lm_head, if written, is the embedding
    if family == "qwen2":  # q/k/v biases
        assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"} <= names
    elif family == "gemma3":  # a sliding-window layer and a global one, query/key norms
        assert config["architectures"] == ["Gemma3ForCausalLM"] and config["tie_word_embeddings"] is True
        assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 32
        assert "model.layers.0.self_attn.q_norm.weight" in names
        assert_the_end_of_turn_token_stops_the_served_reply(stages, out)
    else:
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
        assert "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)
    assert (out / "tokenizer_config.json").exists() or (out / "tokenizer" / "tokenizer_config.json").exists()
    if template is not None:
        assert_the_configured_template_went_everywhere(stages, ckpt, template.read_text())


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.long  # 118 s (finetune 16 s, vLLM serve and its gate most of the rest) at load 0.3-1.5 on 2 cores
@pytest.mark.timeout(900)
def test_a_plain_text_template_trains_on_what_vllm_serves(workspace, baton_home):
    """A Qwen2 with its own byte-level BPE, trained on its chat text, and a plain-text template (`[USER] …` /
    `[BOT] …` on one line, no special token anywhere) → data → finetune → convert → vLLM: the serve
    gate's chat_template_parity finds vLLM's /tokenize of the multi-turn conversation identical to training's, where
    main's turn-by-turn encoding differs with this vocabulary (shown first, so the check could fail)."""
    from transformers import AutoTokenizer

    from test_chat_tokenization import PLAIN, rendered_rows, served, turn_by_turn
    from tasks.serve.smoke import CONVERSATIONS

    tmp_path, files, _ = workspace
    ckpt = own_model(tmp_path / "plain", "qwen2", rendered_rows(PLAIN), hidden=128, template=PLAIN)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    multi = CONVERSATIONS["multi-turn"]
    engine = served(tok, multi, generation_prompt=True)  # what vLLM's /tokenize returns when the check passes
    assert turn_by_turn(tok, multi + [{"role": "assistant", "content": "reply"}])[:len(engine)] != engine
    r = cli("manifest", str(ckpt), home=baton_home)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = write_config(tmp_path / "own.yaml", files)
    r = baton("run", str(cfg), "--from", str(ckpt), "--stages", "data,finetune,serve", *ON_VLLM[2:],
              home=baton_home, timeout=3000)
    summary = summary_of(baton_home, r.stdout)
    assert r.returncode == 0, (r.stderr[-3000:], json.dumps(summary, indent=1)[-4000:])
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "finetune", "convert-zero-to-hf", "serve"], list(stages)
    ev = stages["finetune"]["eval"]
    print(f"plain finetune: {ev} in {stages['finetune'].get('seconds')} s")
    assert stages["finetune"]["gate"]["passed"] and ev["after"] < ev["before"], ev
    parity = next(c for c in stages["serve"]["gate"]["checks"] if c["name"] == "vllm.smoke.chat_template_parity")
    print(f"plain serve: {parity['detail']}")
    assert parity["passed"] and "multi-turn" in parity["detail"], parity
    assert stages["serve"]["gate"]["passed"], stages["serve"]["gate"]
    assert (Path(stages["convert-zero-to-hf"]["output"]) / "tokenizer.json").read_bytes() == \
        (ckpt / "tokenizer.json").read_bytes()  # the served vocabulary is the one the fault was shown with


def assert_the_configured_template_went_everywhere(stages: dict, ckpt: Path, template: str) -> None:
    """The data stage's tokenizer and every checkpoint a chat stage wrote carry the config's template, and render
    with it; the input checkpoint is never written to."""
    from transformers import AutoTokenizer

    assert (Path(stages["data"]["output"]) / "tokenizer" / "chat_template.jinja").read_text() == template
    expected = ("<|user|>\nhi</s>\n<|assistant|>\n" if template == TEMPLATE else
                "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    for label in ("rlhf", "convert-zero-to-hf"):
        out = Path(stages[label]["output"])
        assert (out / "chat_template.jinja").read_text() == template, label
        tok = AutoTokenizer.from_pretrained(str(out))
        rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
        assert rendered == expected, label
    assert not (ckpt / "chat_template.jinja").exists()


def assert_the_end_of_turn_token_stops_the_served_reply(stages: dict, out: Path) -> None:
    """Gemma's template closes a reply with <end_of_turn>, not the base model's eos: rlhf, the stage that wrote the
    template, made it a stop token (and said so), the converted checkpoint kept it, and the server stopped there."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == stops
    assert any(c.startswith("stop_token_ids:") for c in stages["rlhf"]["serving_contract_changed"]), stages["rlhf"]
    contract = next(c for c in stages["rlhf"]["gate"]["checks"] if c["name"] == "contract.serving")
    assert contract["passed"] and "its end-of-turn token stops a reply" in contract["detail"], contract
    stop = next(c for c in stages["serve"]["gate"]["checks"] if c["name"] == "vllm.smoke.stops_at_end_of_turn")
    print(f"gemma3 serve: {stop['detail']}")
    # the trained reply closes its turn within the check's 32 tokens, and vLLM ends it there (not at <eos>, not at
    # max_tokens): a greedy reply that reaches no stop token would pass the check on leakage alone
    assert stop["passed"] and f"reaches stop token {stops[1]} after" in stop["detail"], stop


@pytest.mark.slow
def test_bad_rows_fail_the_data_stage_before_any_engine(workspace, baton_home):
    tmp_path, files, texts = workspace
    lines = files["sft"].read_text().splitlines()
    bad = json.loads(lines[4])
    bad["messages"][2]["role"] = "robot"
    lines[4] = json.dumps(bad)
    files["sft"].write_text("\n".join(lines) + "\n")
    ckpt = own_model(tmp_path / "llama", "llama", texts)
    assert cli("manifest", str(ckpt), home=baton_home).returncode == 0
    r = baton("run", str(write_config(tmp_path / "own.yaml", files)), "--from", str(ckpt), home=baton_home,
              timeout=600)
    assert r.returncode != 0
    expected = f"{files['sft']}:5: field 'messages[2].role': unknown role ('robot'"
    assert expected in r.stderr + r.stdout, (r.stderr + r.stdout)[-3000:]  # the terminal view prints the cause
    summary = summary_of(baton_home, r.stdout) if r.stdout.strip() else json.loads(
        next((baton_home / "runs").glob("*/summary.json")).read_text())
    assert [s["status"] for s in summary["stages"]] == ["failed", "skipped", "skipped", "skipped"]
    assert not any(s.get("registered") for s in summary["stages"])


@pytest.mark.slow
def test_continue_pretraining_an_own_model_with_its_own_tokenizer(workspace, baton_home):
    """data (the model's tokenizer, no new BPE) → HF → Megatron → pretrain → HF, on a Qwen2 (model.arch: its q/k/v
    biases and tied embeddings; a Llama takes the same path less those: the pretrain tests start from one)."""
    tmp_path, files, texts = workspace
    ckpt = own_model(tmp_path / "qwen2", "qwen2", texts)
    assert cli("manifest", str(ckpt), home=baton_home).returncode == 0
    cfg = tmp_path / "cont.yaml"
    cfg.write_text(f"""
name: cont
stages: [data, pretrain]
model: {{arch: qwen2, tie_word_embeddings: true, num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2,
        ffn_hidden_size: 128, seq_length: 256, vocab_size: 512, norm_eps: 1.0e-6}}
data:
  pretrain: {{kind: files, train: "{files['corpus']}"}}
  preference_pairs: 20
  sft_examples: 20
pretrain: {{steps: 4, micro_batch_size: 2, global_batch_size: 2, max_seq_length: 32, lr: 1.0e-3, min_lr: 1.0e-4,
           warmup_steps: 1, checkpoint_every: 4, eval_interval: 4}}
tracking: {{experiment: cont, registered_model: cont-model}}
""")
    r = baton("run", str(cfg), "--from", str(ckpt), home=baton_home, timeout=3000)
    summary = summary_of(baton_home, r.stdout)
    assert r.returncode == 0, (r.stderr[-3000:], json.dumps(summary, indent=1)[-4000:])
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "convert-hf-to-megatron", "pretrain", "convert-megatron-to-hf"]
    assert "input_rewritten" not in stages["pretrain"]  # the conversion's output is sealed: Megatron loads it as is
    assert stages["data"]["tokenizer"].startswith("model:")
    out = Path(stages["convert-megatron-to-hf"]["output"])
    from conversions import manifest as mf

    assert mf.sha256_file(out / "tokenizer.json") == mf.sha256_file(ckpt / "tokenizer.json")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert config["architectures"] == ["Qwen2ForCausalLM"]
