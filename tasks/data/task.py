"""Data stage: build (or load) the three datasets, train the tokenizer, hash and record everything."""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import durable, hf, manifest as mf
from conversions.manifest import Format
from tasks import chat_template, tracking
from tasks.data import formats, sources, synthetic
from tasks.data.config import DATASETS, DataConfig, SourceConfig, validate
from tasks.data.lm_eval_task import write_lm_eval_task
from tasks.data.tokenizer import train_tokenizer
from tasks.stage import StageContext, StageOutput

KINDS = DATASETS
SYNTHETIC_FORMAT = {"pretrain": ("text", {}), "preference": ("preference", {}), "sft": ("alpaca", {"output": "answer"}),
                    "prompts": ("prompt_answer", {})}


def _synthetic_format(kind: str, cfg: DataConfig) -> tuple[str, dict]:
    if _task(kind, cfg) == "calculator" and kind == "sft":
        return "messages", {}
    return SYNTHETIC_FORMAT[kind]


def _canonical_synthetic(kind: str, cfg: DataConfig, rows: list[dict]) -> list[dict]:
    fmt, mapping = _synthetic_format(kind, cfg)
    return [formats.normalise(fmt, r, mapping, f"synthetic:{i}")[0] for i, r in enumerate(rows, start=1)]


def _sums_rng(cfg: DataConfig) -> random.Random:
    """The arithmetic world's own stream: its split is known before the pretraining text is written, and the words
    drawn from the shared stream stay those of the world without it."""
    return random.Random(f"{cfg.seed}:sums")


def _task(kind: str, cfg: DataConfig) -> str:
    """The synthetic task of one dataset (validated: a synthetic source stands alone)."""
    return cfg.sources(kind)[0][1].task


def _arithmetic(cfg: DataConfig) -> bool:
    """The tiny arithmetic world: synthetic default prompts, whose sums the pretraining text states."""
    return [(src.kind, src.task) for _, src in cfg.sources("prompts")] == [("synthetic", "default")]


def _synthetic(kind: str, cfg: DataConfig, rng: random.Random) -> tuple[list, list]:
    if kind == "pretrain":
        sums_rng = _sums_rng(cfg)
        sums = synthetic.all_sums() if _arithmetic(cfg) else []
        docs = synthetic.pretrain_docs(cfg.pretrain_docs, rng, sums, sums_rng)
        k = max(1, int(len(docs) * cfg.heldout_fraction))
        return docs[k:], docs[:k]
    if kind == "preference":
        train, held = synthetic.preference_pairs(cfg.preference_pairs, cfg.heldout_fraction, rng)
    elif kind == "prompts" and _task(kind, cfg) == "instruction":
        train, held = synthetic.instruction_prompts(cfg.arithmetic_prompts, _sums_rng(cfg))
    elif kind == "prompts" and _task(kind, cfg) == "calculator":
        train, held = synthetic.calculator_prompts(cfg.arithmetic_prompts, cfg.seed, rng)
    elif kind == "prompts":
        sums = synthetic.split_sums(_sums_rng(cfg))
        train, held = synthetic.arithmetic_prompts(cfg.arithmetic_prompts, sums, rng)
    elif _task(kind, cfg) == "calculator":
        train, held = synthetic.calculator_episodes(cfg.sft_examples, cfg.seed, rng, cfg.sources(kind)[0][1].by_heart)
    else:
        train, held = synthetic.sft_examples(cfg.sft_examples, cfg.heldout_fraction, cfg.label_noise, rng)
    return _canonical_synthetic(kind, cfg, train), _canonical_synthetic(kind, cfg, held)


def _external(kind: str, key: str, src: SourceConfig, cfg: DataConfig) -> tuple[list, list, dict]:
    """Read, validate and normalise one configured source; the facts the manifest records about it."""
    train = sources.load(kind, src, "train", f"{key}.train")
    sources.check_quality(train, f"{key}.train", cfg.max_bad_fraction)
    facts = {"source": src.kind, "format": train.format, "columns": dict(src.columns), "files": train.files,
             "rows_read": train.read, "rows_bad": dict(train.bad)}
    if src.max_rows is not None:
        facts.update(max_rows=src.max_rows, capped=train.capped)
    if src.kind == "hub":
        facts.update(dataset=src.train, config_name=src.name, revision=src.revision)
    if src.heldout:
        held = sources.load(kind, src, "heldout", f"{key}.heldout", fmt=train.format)
        sources.check_quality(held, f"{key}.heldout", cfg.max_bad_fraction)
        facts.update(heldout_files=held.files, heldout_rows_read=held.read, heldout_rows_bad=dict(held.bad))
        return train.rows, held.rows, facts
    tr, he = sources.split_heldout(train.rows, cfg.heldout_fraction, cfg.seed, key)
    return tr, he, facts


def _mixed(kind: str, cfg: DataConfig) -> tuple[list, list, dict]:
    """A list of sources: each read, validated and split on its own (its heldout, or split off its own rows), then
    concatenated in list order; the facts name every source and where its rows lie in train/heldout.jsonl."""
    train, held, per_source = [], [], []
    for i, (key, src) in enumerate(cfg.sources(kind)):
        tr, he, facts = _external(kind, key, src, cfg)
        facts.update(index=i, train={"rows": len(tr), "range": [len(train), len(train) + len(tr)]},
                     heldout={"rows": len(he), "range": [len(held), len(held) + len(he)]})
        train.extend(tr)
        held.extend(he)
        per_source.append(facts)
    bad: Counter = sum((Counter(f["rows_bad"]) for f in per_source), Counter())
    formats_used = list(dict.fromkeys(f["format"] for f in per_source))
    return train, held, {"source": "+".join(sorted({f["source"] for f in per_source})),
                         "format": "+".join(formats_used), "rows_read": sum(f["rows_read"] for f in per_source),
                         "rows_bad": dict(bad), "files": [p for f in per_source for p in f["files"]],
                         "sources": per_source}


def build_datasets(cfg: DataConfig) -> tuple[dict[str, tuple[list, list]], dict[str, dict]]:
    """Every dataset in canonical form (train, held-out), and per dataset its source, format, mapping and counts."""
    errors = validate(cfg)  # (the CLI checked them at load; a direct caller gets the same refusal)
    if errors:
        raise sources.DataError("; ".join(errors))
    rng = random.Random(cfg.seed)
    sets: dict[str, tuple[list, list]] = {}
    facts: dict[str, dict] = {}
    for kind in KINDS:  # synthetic generation order fixes the random stream: keep it (prompts, optional, come last)
        listed = cfg.sources(kind)
        if not listed:
            continue
        if listed[0][1].kind == "synthetic":  # (validated: synthetic is never mixed)
            sets[kind] = _synthetic(kind, cfg, rng)
            facts[kind] = {"source": "synthetic", "format": _synthetic_format(kind, cfg)[0]}
            if _task(kind, cfg) != "default":
                facts[kind]["task"] = _task(kind, cfg)
        elif isinstance(getattr(cfg, kind), list):
            train, held, facts[kind] = _mixed(kind, cfg)
            sets[kind] = (train, held)
        else:
            train, held, facts[kind] = _external(kind, *listed[0], cfg)
            sets[kind] = (train, held)
    return sets, facts


def _texts(sets: dict[str, tuple[list, list]]):
    for kind, (train, held) in sets.items():
        for row in train + held:
            yield " ".join(formats.texts_of(kind, row))


def model_tokenizer_source(ctx: StageContext, cfg: DataConfig) -> Path | None:
    """The input checkpoint whose tokenizer the data stage uses, or None to train a new one."""
    usable = (ctx.input is not None and ctx.input_format == Format.HF_SAFETENSORS
              and (Path(ctx.input) / "tokenizer_config.json").exists())
    if cfg.tokenizer == "model" and not usable:
        raise sources.DataError(f"data.tokenizer: 'model' needs an HF checkpoint with a tokenizer as the run's input "
                                f"(--from); input is {ctx.input or 'none'}")
    return Path(ctx.input) if usable and cfg.tokenizer != "train" else None


def make_tokenizer(ctx: StageContext, cfg: DataConfig, sets: dict, out: Path) -> dict:
    src = model_tokenizer_source(ctx, cfg)
    if src is None:
        tok = train_tokenizer(_texts(sets), ctx.model["vocab_size"], out)
        return {"vocab_size": len(tok), "path": "tokenizer", "source": "trained", "eos_token": tok.eos_token}
    from transformers import AutoTokenizer

    hf.copy_tokenizer(src, out)
    chat_template.write_if_missing(ctx.model.get("chat_template"), out)
    tok = AutoTokenizer.from_pretrained(str(out))
    return {"vocab_size": len(tok), "path": "tokenizer", "source": f"model:{src}", "eos_token": tok.eos_token,
            "chat_template": mf.chat_template_present(out)}


def write_rows(path: Path, rows: list[dict]) -> None:
    durable.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_data(ctx: StageContext, cfg: DataConfig) -> tuple[Path, dict]:
    out = ctx.work_dir
    sets, facts = build_datasets(cfg)
    info: dict = {}
    for name, (train, held) in sets.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        info[name] = dict(facts[name])
        for split, rows in (("train", train), ("heldout", held)):
            path = out / name / f"{split}.jsonl"
            write_rows(path, rows)
            info[name][split] = {"path": f"{name}/{split}.jsonl", "rows": len(rows), "sha256": mf.sha256_file(path)}
    info["tokenizer"] = make_tokenizer(ctx, cfg, sets, out / "tokenizer")
    return out, info


# log_prints off: dill (under `datasets`) finds globals by capturing print() from dis.dis; Prefect would log every
# bytecode line instead (and dill would see none).
@task(name="data", cache_policy=NO_CACHE, log_prints=False)
def run_data(ctx: StageContext, cfg: DataConfig) -> StageOutput:
    out, info = write_data(ctx, cfg)
    write_lm_eval_task(out, stop=info["tokenizer"]["eos_token"])
    m = mf.build(out, format=Format.DATASET, stage="data",
                 engine={"name": "datasets", **mf.engine_versions("datasets", "tokenizers")},
                 extra={"datasets": {k: v for k, v in info.items() if k != "tokenizer"}, "revision": cfg.revision,
                        "vocab_size": info["tokenizer"]["vocab_size"], "tokenizer": info["tokenizer"]["source"]},
                 tokenizer_dir=out / "tokenizer")
    mf.write(out, m)
    if ctx.mlflow_run_id:
        c = tracking.client()
        for name in (n for n in KINDS if n in info):
            for split in ("train", "heldout"):
                d = info[name][split]
                tracking.log_dataset(c, ctx.mlflow_run_id, out / d["path"], f"{name}-{split}",
                                     "training" if split == "train" else "evaluation", d["sha256"])
    made = [n for n in KINDS if n in info]
    metrics = {f"{n}_{s}_rows": info[n][s]["rows"] for n in made for s in ("train", "heldout")}
    metrics["vocab_size"] = info["tokenizer"]["vocab_size"]
    for n in made:
        for reason, count in info[n].get("rows_bad", {}).items():
            metrics[f"{n}_bad_{reason}"] = count
    from conversions.verify import integrity

    gate = {"passed": True, "checks": integrity(out)}
    gate["passed"] = all(c["passed"] for c in gate["checks"])
    return StageOutput(output=out, engine="datasets", backend=cfg.backend(),
                       gate=gate, metrics=metrics,
                       extra={"formats": {n: info[n]["format"] for n in made}, "tokenizer": info["tokenizer"]["source"]})
