"""Mixed datasets: data.sft / data.preference / data.pretrain as a list of sources, each in its own format and column
mapping, normalised into the one canonical form, split per source, concatenated, and recorded per source. Pure
except the last test, which runs `baton run --stages data` through the CLI (Prefect, no engine)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.config import ConfigError, load
from tasks.data.config import DataConfig
from tasks.data.sources import DataError

from conftest import TINY, baton

SYSTEM = {"role": "system", "content": "Be brief."}


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def alpaca(i: int) -> dict:
    return {"q": f"What is {i} plus {i}?", "a": f"{2 * i}"}


def sharegpt(i: int) -> dict:
    return {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"{i}+1?"},
                              {"from": "gpt", "value": f"{i + 1}"}]}


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": f"{i}*2?"}, {"role": "assistant", "content": f"{2 * i}"}]}


def string_pair(i: int) -> dict:
    return {"prompt": f"{i}+{i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"}


def message_pair(i: int) -> dict:
    return {"prompt": [SYSTEM, {"role": "user", "content": f"{i}-1?"}],
            "chosen": [{"role": "assistant", "content": f"{i - 1}"}],
            "rejected": [{"role": "assistant", "content": f"{i + 1}"}]}


def sft_sources(tmp_path: Path) -> list[dict]:
    """Alpaca under other column names (8 rows, capped at 6), ShareGPT with its own held-out file, chat messages."""
    return [
        {"kind": "files", "train": str(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca(i) for i in range(8)])),
         "format": "alpaca", "columns": {"instruction": "q", "output": "a"}, "max_rows": 6},
        {"kind": "files", "train": str(write_jsonl(tmp_path / "share" / "train.jsonl", [sharegpt(i) for i in range(5)])),
         "heldout": str(write_jsonl(tmp_path / "share" / "held.jsonl", [sharegpt(i) for i in range(100, 102)]))},
        {"kind": "files", "train": str(write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(10)]))},
    ]


def preference_sources(tmp_path: Path) -> list[dict]:
    return [{"kind": "files", "train": str(write_jsonl(tmp_path / "pairs.jsonl", [string_pair(i) for i in range(10)]))},
            {"kind": "files", "train": str(write_jsonl(tmp_path / "conv.jsonl", [message_pair(i) for i in range(5)]))}]


def build(**data):
    from tasks.data.task import build_datasets

    return build_datasets(DataConfig(heldout_fraction=0.2, **data))


# ---- config ---------------------------------------------------------------------------------------------------------
def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(TINY, list(overrides), stages=["data"])
    return str(e.value)


@pytest.mark.fast
def test_one_source_stays_as_it_was_and_a_list_names_each_source(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(0)])
    one = load(TINY, ["data.sft.kind=files", f"data.sft.train={f}"], stages=["data"]).data
    assert one.sources("sft") == [("data.sft", one.sft)] and one.sft.train == str(f)
    many = load(TINY, [f"data.sft=[{{kind: files, train: {f}}}, {{kind: files, train: {f}, max_rows: 2}}]",
                       "data.sft[1].format=alpaca"], stages=["data"]).data
    assert [k for k, _ in many.sources("sft")] == ["data.sft[0]", "data.sft[1]"]
    assert many.sft[1].format == "alpaca" and many.sft[1].max_rows == 2 and many.backend() == "files"
    assert load(TINY, stages=["data"]).data.backend() == "synthetic"


@pytest.mark.fast
def test_list_errors_name_the_index(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(0)])
    assert "data.sft[1].columns: Input should be a valid dictionary (got 3)" in refused(
        f"data.sft=[{{kind: files, train: {f}}}, {{kind: files, train: {f}, columns: 3}}]")
    assert "data.sft[0].bogus: unknown key" in refused(f"data.sft=[{{kind: files, train: {f}, bogus: 1}}]")
    assert "data.sft.bogus: unknown key" in refused(f"data.sft={{kind: files, train: {f}, bogus: 1}}")
    assert "data.sft[1].max_rows: Input should be greater than or equal to 1" in refused(
        f"data.sft=[{{kind: files, train: {f}}}, {{kind: files, train: {f}, max_rows: 0}}]")
    assert "data.sft[1].train: /nowhere/*.jsonl matches no file" in refused(
        f"data.sft=[{{kind: files, train: {f}}}, {{kind: files, train: /nowhere/*.jsonl}}]")
    assert "data.preference[1].format: 'alpaca' is not a preference format (preference, implicit_preference)" in refused(
        f"data.preference=[{{kind: files, train: {f}}}, {{kind: files, train: {f}, format: alpaca}}]")
    assert "data.sft: an empty list of sources" in refused("data.sft=[]")
    assert "--set data.sft[3].train: 3 is not an index of that list (0..0)" in refused(
        f"data.sft=[{{kind: files, train: {f}}}]", "data.sft[3].train=x")


@pytest.mark.fast
def test_synthetic_is_never_mixed(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(0)])
    msg = refused(f"data.sft=[{{kind: synthetic}}, {{kind: files, train: {f}}}]")
    assert "data.sft: a synthetic source cannot be mixed with others (its size is data.sft_examples" in msg
    assert "data.sft[0].max_rows: applies to files and hub sources" in refused("data.sft=[{kind: synthetic, max_rows: 5}]")
    assert load(TINY, ["data.sft=[{kind: synthetic}]"], stages=["data"]).data.backend() == "synthetic"
    with pytest.raises(DataError, match=r"data\.sft: a synthetic source cannot be mixed"):  # without the CLI too
        build(sft=[{"kind": "synthetic"}, {"kind": "files", "train": str(f)}])


# ---- building the datasets ------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_mixed_sft_list_normalises_each_format_and_records_each_source(tmp_path):
    sets, facts = build(sft=sft_sources(tmp_path))
    train, held = sets["sft"]
    sft = facts["sft"]
    assert sft["source"] == "files" and sft["format"] == "alpaca+sharegpt+messages"
    assert sft["rows_read"] == 6 + 5 + 10 and sft["rows_bad"] == {}
    a, s, m = sft["sources"]
    assert (a["format"], a["columns"], a["max_rows"], a["capped"]) == ("alpaca", {"instruction": "q", "output": "a"}, 6, True)
    assert (a["rows_read"], a["train"]["rows"], a["heldout"]["rows"]) == (6, 5, 1)   # 6 of 8 taken, 20% held out
    assert (s["format"], s["train"]["rows"], s["heldout"]["rows"]) == ("sharegpt", 5, 2)  # its own held-out file
    assert [Path(p).name for p in s["heldout_files"]] == ["held.jsonl"]
    assert (m["format"], m["train"]["rows"], m["heldout"]["rows"]) == ("messages", 8, 2)
    assert [x["train"]["range"] for x in (a, s, m)] == [[0, 5], [5, 10], [10, 18]]
    assert [x["heldout"]["range"] for x in (a, s, m)] == [[0, 1], [1, 3], [3, 5]]
    assert len(train) == 18 and len(held) == 5
    assert all(set(r) == {"messages"} and r["messages"][-1]["role"] == "assistant" for r in train + held)
    assert {r["messages"][0]["content"] for r in train[:5]} <= {f"What is {i} plus {i}?" for i in range(6)}
    assert train[5]["messages"][:2] == [SYSTEM, {"role": "user", "content": "0+1?"}]
    assert held[1]["messages"][-1] == {"role": "assistant", "content": "101"}
    assert [r["role"] for r in train[10]["messages"]] == ["user", "assistant", "user", "assistant"]


@pytest.mark.fast
def test_mixed_preference_list_strings_and_message_lists(tmp_path):
    sets, facts = build(preference=preference_sources(tmp_path))
    train, held = sets["preference"]
    pref = facts["preference"]
    assert pref["format"] == "preference" and [s["format"] for s in pref["sources"]] == ["preference", "preference"]
    assert [(s["train"]["rows"], s["heldout"]["rows"]) for s in pref["sources"]] == [(8, 2), (4, 1)]
    assert len(train) == 12 and len(held) == 3
    for r in train + held:
        assert set(r) == {"prompt", "chosen", "rejected"} and r["prompt"][-1]["role"] == "user"
        assert [m["role"] for m in r["chosen"] + r["rejected"]] == ["assistant", "assistant"]
    assert all(r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}] for r in train[:8])
    assert all(r["prompt"][0] == SYSTEM for r in train[8:])


@pytest.mark.fast
def test_mixed_pretraining_text_files_and_rows_under_another_column(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.md").write_text("first doc\n\nsecond doc\n\nthird doc\n")
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"body": f"row {i}"} for i in range(4)])
    sets, facts = build(pretrain=[{"kind": "files", "train": str(tmp_path / "corpus")},
                                  {"kind": "files", "train": str(rows), "columns": {"text": "body"}, "max_rows": 3}])
    train, held = sets["pretrain"]
    assert [(s["format"], s["rows_read"], s["train"]["rows"], s["heldout"]["rows"])
            for s in facts["pretrain"]["sources"]] == [("text", 3, 2, 1), ("text", 3, 2, 1)]
    assert sorted(r["text"] for r in train + held) == ["first doc", "row 0", "row 1", "row 2", "second doc", "third doc"]


@pytest.mark.fast
def test_a_bad_row_in_the_second_source_names_it(tmp_path):
    srcs = sft_sources(tmp_path)
    bad = [sharegpt(0), sharegpt(1), {"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]}]
    write_jsonl(tmp_path / "share" / "train.jsonl", bad)
    with pytest.raises(DataError) as e:
        build(sft=srcs)
    assert str(e.value).startswith(f"data.sft[1].train: {tmp_path}/share/train.jsonl:3: field "
                                   "'conversations[1].from': unknown role ('robot'")
    _, facts = build(sft=srcs, max_bad_fraction=0.5)                  # tolerated: skipped, counted on its source
    assert facts["sft"]["sources"][1]["rows_bad"] == {"unknown_role": 1} and facts["sft"]["rows_bad"] == {"unknown_role": 1}


@pytest.mark.fast
def test_sft_rows_in_a_preference_list_are_refused(tmp_path):
    srcs = preference_sources(tmp_path) + [{"kind": "files", "train": str(tmp_path / "chat.jsonl")}]
    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(3)])
    with pytest.raises(DataError, match=r"^data\.preference\[2\]: .*chat\.jsonl holds sft data \(messages columns "
                                        r"\['messages'\]\), not preference data; data\.preference takes only "
                                        r"preference, implicit_preference"):
        build(preference=srcs)


@pytest.mark.fast
def test_the_fingerprint_sees_every_source(tmp_path, baton_home):
    from tasks.data.digest import file_digests

    cfg = DataConfig(sft=sft_sources(tmp_path))
    names = [Path(p).name for p, _ in file_digests(cfg)]
    assert names == ["alpaca.jsonl", "train.jsonl", "held.jsonl", "chat.jsonl"]
    before = file_digests(cfg)
    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(11)])  # the third source's file changes
    after = file_digests(cfg)
    assert after[:3] == before[:3] and after[3] != before[3]


# ---- through the CLI: the data stage's manifest ---------------------------------------------------------------------
@pytest.mark.slow  # the data stage through the CLI and Prefect (tokenizer training on ~50 rows; no engine)
def test_baton_run_data_with_mixed_lists(tmp_path, baton_home):
    import yaml

    cfg = tmp_path / "mixed.yaml"
    cfg.write_text(yaml.safe_dump({"name": "mixed", "stages": ["data"], "data": {
        "pretrain_docs": 20, "heldout_fraction": 0.2,
        "sft": sft_sources(tmp_path), "preference": preference_sources(tmp_path)}}))
    r = baton("run", str(cfg), "--stages", "data", home=baton_home, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    run = r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1]
    (stage,) = json.loads((baton_home / "runs" / run / "summary.json").read_text())["stages"]
    assert stage["status"] == "completed" and stage["gate"]["passed"]
    out = Path(stage["output"])
    datasets = json.loads((out / "baton_manifest.json").read_text())["extra"]["datasets"]
    sft, pref = datasets["sft"], datasets["preference"]
    assert (sft["train"]["rows"], sft["heldout"]["rows"]) == (18, 5) and sft["source"] == "files"
    assert [(s["index"], s["format"], s["train"]["rows"], s["heldout"]["rows"]) for s in sft["sources"]] == [
        (0, "alpaca", 5, 1), (1, "sharegpt", 5, 2), (2, "messages", 8, 2)]
    assert [Path(f).name for f in sft["sources"][0]["files"]] == ["alpaca.jsonl"]
    assert (pref["train"]["rows"], pref["heldout"]["rows"]) == (12, 3) and len(pref["sources"]) == 2
    assert datasets["pretrain"]["source"] == "synthetic"
    rows = [json.loads(line) for line in (out / "sft" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and all(set(r) == {"messages"} for r in rows)
