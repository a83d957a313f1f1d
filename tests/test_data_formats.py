"""Your own data: every format the field uses normalised into one canonical chat form, bad rows named by file, line
and field before any engine starts, chat rendering with loss on every assistant turn, the held-out gates, and a data
fingerprint that sees the files. Pure: no engine, no server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.data.config import DataConfig
from tasks.data.sources import DataError

pytestmark = pytest.mark.fast

SYSTEM = {"role": "system", "content": "Be brief."}
TOOL_EPISODE = [{"role": "user", "content": "37*48="}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "1776"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def build(tmp_path, kind: str, rows: list, **src) -> tuple[list, list, dict]:
    from tasks.data.task import build_datasets

    f = write_jsonl(tmp_path / f"{kind}.jsonl", rows)
    cfg = DataConfig(**{kind: {"kind": "files", "train": str(f), **src}})
    sets, facts = build_datasets(cfg)
    return sets[kind][0], sets[kind][1], facts[kind]


def canonical(tmp_path, kind: str, rows: list, **src) -> tuple[list, dict]:
    train, held, facts = build(tmp_path, kind, rows, **src)
    return train + held, facts


# ---- SFT formats ------------------------------------------------------------------------------------------------------
SFT_CASES = {
    "alpaca": ({"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be brief."},
               [SYSTEM, {"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}]),
    "prompt_completion": ({"prompt": "Add 2 and 3", "completion": "5"},
                          [{"role": "user", "content": "Add 2 and 3"}, {"role": "assistant", "content": "5"}]),
    "messages": ({"messages": [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                               {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]},
                 [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]),
    "tool": ({"messages": TOOL_EPISODE}, TOOL_EPISODE),  # a tool's result answers the assistant's call (rlhf.tools)
    "sharegpt": ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+3?"},
                                    {"from": "gpt", "value": "5"}]},
                 [SYSTEM, {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]),
}


@pytest.mark.parametrize("fmt", sorted(SFT_CASES))
def test_sft_formats_are_detected_and_normalised_to_messages(tmp_path, fmt):
    row, expected = SFT_CASES[fmt]
    rows, facts = canonical(tmp_path, "sft", [row] * 4)
    assert facts["format"] == ("messages" if fmt == "tool" else fmt) and facts["rows_read"] == 4 and facts["rows_bad"] == {}
    assert rows == [{"messages": expected}] * 4


def test_columns_mapping_and_declared_format(tmp_path):
    rows, facts = canonical(tmp_path, "sft", [{"question": "2+3?", "reply": "5"}] * 3, format="alpaca",
                            columns={"instruction": "question", "output": "reply"})
    assert facts["format"] == "alpaca" and facts["columns"] == {"instruction": "question", "output": "reply"}
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "5"}
    with pytest.raises(DataError, match=r"data\.sft.*cannot tell the format.*set data\.sft\.format"):
        canonical(tmp_path, "sft", [{"question": "2+3?", "reply": "5"}] * 3)
    with pytest.raises(DataError, match=r"data\.sft\.format: 'text' is not a sft format"):
        canonical(tmp_path, "sft", [{"text": "x"}] * 3, format="text")


def test_conversational_prompt_completion(tmp_path):
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "completion": [{"role": "assistant", "content": "5"}]}
    rows, _ = canonical(tmp_path, "sft", [row] * 2)
    assert rows[0]["messages"] == [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]


# ---- preference formats -----------------------------------------------------------------------------------------------
def test_preference_strings_messages_and_implicit_prompt(tmp_path):
    expected = {"prompt": [{"role": "user", "content": "2+3?"}], "chosen": [{"role": "assistant", "content": "5"}],
                "rejected": [{"role": "assistant", "content": "6"}]}
    rows, facts = canonical(tmp_path / "s", "preference", [{"prompt": "2+3?", "chosen": "5", "rejected": "6"}] * 2)
    assert facts["format"] == "preference" and rows[0] == expected
    rows, _ = canonical(tmp_path / "m", "preference", [expected] * 2)
    assert rows[0] == expected
    convo = [SYSTEM, {"role": "user", "content": "2+3?"}]
    implicit = {"chosen": convo + [{"role": "assistant", "content": "5"}],
                "rejected": convo + [{"role": "assistant", "content": "6"}]}
    rows, facts = canonical(tmp_path / "i", "preference", [implicit] * 2)
    assert facts["format"] == "implicit_preference"
    assert rows[0] == {"prompt": convo, "chosen": expected["chosen"], "rejected": expected["rejected"]}


def test_text_files_and_folders_for_pretraining(tmp_path):
    from tasks.data.task import build_datasets

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.md").write_text("# Title\nfirst paragraph\n\nsecond paragraph\n")
    (tmp_path / "corpus" / "b.txt").write_text("third\n\n\nfourth\n")
    sets, facts = build_datasets(DataConfig(pretrain={"kind": "files", "train": str(tmp_path / "corpus")}))
    texts = sorted(r["text"] for r in sets["pretrain"][0] + sets["pretrain"][1])
    assert texts == ["# Title\nfirst paragraph", "fourth", "second paragraph", "third"]
    assert facts["pretrain"]["format"] == "text" and len(facts["pretrain"]["files"]) == 2


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tasks.data.task import build_datasets

    pq.write_table(pa.Table.from_pylist([{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)]),
                   tmp_path / "sft.parquet")
    sets, facts = build_datasets(DataConfig(sft={"kind": "files", "train": str(tmp_path / "*.parquet")}))
    assert facts["sft"]["format"] == "alpaca" and len(sets["sft"][0]) + len(sets["sft"][1]) == 5


# ---- validation: one message naming file, line and field ------------------------------------------------------------
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_ROWS = {
    "missing": ({"other": 1}, "field 'messages': missing"),
    "null": ({"messages": None}, "field 'messages': null"),
    "wrong_type": ({"messages": "hi"}, "field 'messages': wrong type (expected a list of messages, got str)"),
    "empty": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
              "field 'messages[1].content': empty"),
    "unknown_role": ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
                     "field 'messages[1].role': unknown role ('robot'"),
    "role_order": ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}]},
                   "field 'messages[0].role': role order ('assistant' where 'user' was expected"),
    "tool_first": ({"messages": [{"role": "tool", "content": "7"}, {"role": "assistant", "content": "7"}]},
                   "field 'messages[0].role': role order ('tool' where 'user' was expected"),
    "no_reply": ({"messages": [{"role": "user", "content": "hi"}]}, "field 'messages': role order (must end with"),
    "invalid_json": ('{"messages": [', "field '(line)': invalid json"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_each_bad_row_is_named_by_file_line_and_field(tmp_path, case):
    bad, expected = BAD_ROWS[case]
    with pytest.raises(DataError) as e:
        build(tmp_path, "sft", [GOOD, GOOD, bad, GOOD])
    msg = str(e.value)
    assert f"{tmp_path / 'sft.jsonl'}:3: {expected}" in msg, msg
    assert "1 of 4 rows bad" in msg and "data.max_bad_fraction is 0.0" in msg and msg.startswith("data.sft.train: ")


def test_bad_rows_under_the_threshold_are_skipped_and_counted(tmp_path):
    from tasks.data.task import build_datasets

    f = write_jsonl(tmp_path / "sft.jsonl", [GOOD] * 8 + [{"messages": None}, {"other": 1}])
    sets, facts = build_datasets(DataConfig(max_bad_fraction=0.2, sft={"kind": "files", "train": str(f)}))
    assert len(sets["sft"][0]) + len(sets["sft"][1]) == 8
    assert facts["sft"]["rows_bad"] == {"null": 1, "missing": 1} and facts["sft"]["rows_read"] == 10


def test_wrong_typed_preference_and_empty_split(tmp_path):
    with pytest.raises(DataError, match=r"preference\.jsonl:2: field 'chosen': wrong type \(expected a string or a list of messages, got int\)"):
        build(tmp_path, "preference", [{"prompt": "p", "chosen": "a", "rejected": "b"},
                                       {"prompt": "p", "chosen": 5, "rejected": "b"}])
    empty = write_jsonl(tmp_path / "empty" / "held.jsonl", [])
    with pytest.raises(DataError, match=r"data\.sft\.heldout: no rows"):
        build(tmp_path, "sft", [GOOD] * 3, heldout=str(empty))
    with pytest.raises(DataError, match=r"data\.sft\.train: no files match"):
        from tasks.data.task import build_datasets

        build_datasets(DataConfig(sft={"kind": "files", "train": str(tmp_path / "nothing*.jsonl")}))


def test_hub_source_offline_is_one_message(tmp_path, monkeypatch):
    from tasks.data.task import build_datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    cfg = DataConfig(sft={"kind": "hub", "train": "someone/instructions", "name": "en", "revision": "v2"})
    with pytest.raises(DataError) as e:
        build_datasets(cfg)
    msg = str(e.value)
    assert msg.startswith("data.sft.train: hub dataset 'someone/instructions' (config en, revision v2, split 'train')")
    assert "offline mode is on" in msg and "\n" not in msg


# ---- chat rendering: loss on every assistant turn ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tasks.data.tokenizer import train_tokenizer

    texts = ["hello there", "the answer is five", "Be brief.", "what is two plus three"] * 20
    return train_tokenizer(texts, 400, tmp_path_factory.mktemp("tok"))


def test_multi_turn_learns_every_assistant_turn_and_nothing_else(tok):
    from tasks import chat

    msgs = [SYSTEM, {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "five"}]
    e = chat.encode(tok, msgs, 512)
    learned = [t for t, lab in zip(e.ids, e.labels) if lab != chat.IGNORE]
    assert tok.decode(learned) == "hello<|im_end|>five<|im_end|>"
    assert tok.decode(e.ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert chat.encode(tok, msgs, 10) is None  # over-long: dropped
    cut = chat.encode(tok, msgs, len(e.ids) - 3, overlong="truncate")
    assert cut.truncated and len(cut.ids) == len(e.ids) - 3


def test_preference_sides_render_through_the_template(tok):
    from tasks import chat

    prompt, reply = chat.completion(tok, [SYSTEM, {"role": "user", "content": "hi"}],
                                    [{"role": "assistant", "content": "five"}])
    assert prompt.endswith("<|im_start|>assistant\n") and prompt.startswith("<|im_start|>system\nBe brief.")
    assert reply == "five<|im_end|>"


# ---- gates ------------------------------------------------------------------------------------------------------------
def test_gate_rules():
    from tasks import gates

    assert gates.check("heldout_loss", 2.0, 1.5, 0.0)["passed"]
    assert not gates.check("heldout_loss", 2.0, 2.0, 0.0)["passed"]  # must improve
    assert not gates.check("heldout_loss", 2.0, 1.9, 0.2)["passed"]  # by more than the margin
    assert gates.check("exact_match", 0.1, 0.3, 0.0)["passed"] and not gates.check("exact_match", 0, 0, 0)["passed"]
    assert gates.check("preference_accuracy", 1.0, 1.0, 0.0)["passed"]  # rlhf: must not fall
    assert not gates.check("heldout_loss", None, 1.0, 0.0)["passed"]


def test_gate_metric_defaults_follow_the_data(tmp_path):
    from conversions import manifest as mf
    from tasks import gates

    mf.write(tmp_path, mf.build(tmp_path, format="dataset", stage="data", extra={"datasets": {
        "sft": {"source": "files"}, "preference": {"source": "synthetic"}}}))
    auto = gates.GateConfig()
    assert gates.resolve_metric(auto, tmp_path, "sft", "exact_match") == "heldout_loss"
    assert gates.resolve_metric(auto, tmp_path, "preference", "preference_accuracy") == "preference_accuracy"
    assert gates.resolve_metric(gates.GateConfig(metric="exact_match"), tmp_path, "sft", "x") == "exact_match"


def test_stage_configs_refuse_a_metric_of_the_other_stage():
    from flows.config import ConfigError, load

    from conftest import TINY

    for key, metric in (("finetune", "preference_accuracy"), ("rlhf", "exact_match")):
        with pytest.raises(ConfigError, match=rf"{key}\.gate\.metric: {metric} is an? (rlhf|finetune) metric"):
            load(TINY, [f"{key}.gate.metric={metric}"])


def test_lm_eval_task_reads_canonical_rows(tmp_path):
    import jinja2

    from tasks.data import lm_eval_task

    cfg = lm_eval_task.task_config(tmp_path / "heldout.jsonl", stop="</s>")
    doc = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}
    env = jinja2.Environment()
    assert env.from_string(cfg["doc_to_text"]).render(**doc) == "2+3?"
    assert env.from_string(cfg["doc_to_target"]).render(**doc) == "5"
    assert cfg["generation_kwargs"]["until"] == ["</s>"]


# ---- the fingerprint sees the files -------------------------------------------------------------------------------
def test_data_fingerprint_follows_file_contents(tmp_path, baton_home):
    import os

    from flows.config import load
    from flows.chain_planner import plan

    from conftest import TINY

    folder = tmp_path / "sft"
    write_jsonl(folder / "a.jsonl", [GOOD] * 3)
    cfg = load(TINY, [f"data.sft.kind=files", f"data.sft.train={folder}/*.jsonl"])

    def data_fp():
        return plan(cfg)[0].fingerprint

    first = data_fp()
    assert data_fp() == first                                   # nothing changed: same fingerprint (cached)
    st = (folder / "a.jsonl").stat()
    os.utime(folder / "a.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert data_fp() == first                                   # touched, same bytes: re-hashed, same fingerprint
    write_jsonl(folder / "b.jsonl", [GOOD])
    added = data_fp()
    assert added != first                                       # a new file under the glob re-runs data
    write_jsonl(folder / "b.jsonl", [GOOD, GOOD])
    assert data_fp() not in (first, added)                      # a changed file too
    steps = plan(cfg)
    assert all(s.fingerprint != "" for s in steps) and steps[1].fingerprint != plan(load(TINY))[1].fingerprint


def test_nemo_rl_reads_the_canonical_pairs_as_binary_preferences(tmp_path):
    from tasks.rlhf import nemo_rl

    pair = {"prompt": [SYSTEM, {"role": "user", "content": "2+3?"}],
            "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]}
    for split in ("train", "heldout"):
        write_jsonl(tmp_path / "data" / "preference" / f"{split}.jsonl", [pair])
    paths = nemo_rl.preference_files(tmp_path / "data", tmp_path / "nr")
    assert json.loads(paths["train"].read_text()) == {"prompt": pair["prompt"], "chosen": "5", "rejected": "6"}
    two = dict(pair, chosen=pair["chosen"] * 2)
    write_jsonl(tmp_path / "data" / "preference" / "train.jsonl", [pair, two])
    with pytest.raises(ValueError, match=r"train\.jsonl:2: NeMo-RL's BinaryPreferenceDataset takes one reply"):
        nemo_rl.preference_files(tmp_path / "data", tmp_path / "nr")


@pytest.mark.reliability
def test_parquet_stops_reading_at_max_rows(tmp_path, record_property):
    """A source with max_rows reads row group by row group: the groups after the cap are never read. The last of ten
    row groups is corrupted on disk; reading the file whole (as before) failed on it."""
    record_property("fault", "parquet read whole before max_rows")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tasks.data import sources
    from tasks.data.config import SourceConfig

    path = tmp_path / "sft.parquet"
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(1000)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="none", use_dictionary=False)
    last = pq.ParquetFile(path).metadata.row_group(9).column(0)
    with open(path, "r+b") as f:
        f.seek(last.data_page_offset)
        f.write(b"\xff" * 32)  # the page header of the last row group: unreadable
    src = SourceConfig(kind="files", train=str(path), max_rows=150)
    loaded = sources.load("sft", src, "train", "data.sft.train")
    assert len(loaded.rows) == 150 and loaded.capped and loaded.read == 150
    assert loaded.rows[149] == sources.formats.normalise("alpaca", rows[149], src.columns, "x")[0]
