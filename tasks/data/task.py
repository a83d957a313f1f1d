"""Data stage: build (or load) the three datasets, train the tokenizer, hash and record everything."""
from __future__ import annotations

import glob
import random
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import manifest as mf
from tasks import tracking
from tasks.data import synthetic
from tasks.data.config import DataConfig, SourceConfig
from tasks.data.lm_eval_task import write_lm_eval_task
from tasks.data.tokenizer import train_tokenizer
from tasks.stage import StageContext, StageOutput

COLUMNS = {"pretrain": ["text"], "preference": ["prompt", "chosen", "rejected"], "sft": ["instruction", "answer"]}


def _load_external(name: str, src: SourceConfig, seed: int, heldout_fraction: float) -> tuple[list, list]:
    """Local jsonl/parquet/text files or a hub dataset, through the `datasets` library."""
    import datasets

    if src.kind == "hub":
        ds = datasets.load_dataset(src.train, split=src.split)
        held = datasets.load_dataset(src.train, split=src.heldout) if src.heldout else None
    else:
        def load(pattern):
            files = sorted(glob.glob(pattern))
            if not files:
                raise FileNotFoundError(f"data.{name}.train: no files match {pattern!r}")
            ext = Path(files[0]).suffix.lstrip(".")
            builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "txt": "text", "text": "text"}.get(ext)
            if builder is None:
                raise ValueError(f"data.{name}: unsupported file type {ext!r} (jsonl, json, parquet, txt)")
            return datasets.load_dataset(builder, data_files=files, split="train")

        ds = load(src.train)
        held = load(src.heldout) if src.heldout else None
    if held is None:
        parts = ds.train_test_split(test_size=heldout_fraction, seed=seed)
        ds, held = parts["train"], parts["test"]
    missing = [c for c in COLUMNS[name] if c not in ds.column_names]
    if missing:
        raise ValueError(f"data.{name}: dataset lacks column(s) {missing}; has {ds.column_names}")
    cols = COLUMNS[name]
    return [{c: r[c] for c in cols} for r in ds], [{c: r[c] for c in cols} for r in held]


def build_datasets(cfg: DataConfig) -> dict[str, tuple[list, list]]:
    rng = random.Random(cfg.seed)
    out: dict[str, tuple[list, list]] = {}
    if cfg.pretrain.kind == "synthetic":
        docs = synthetic.pretrain_docs(cfg.pretrain_docs, rng)
        k = max(1, int(len(docs) * cfg.heldout_fraction))
        out["pretrain"] = (docs[k:], docs[:k])
    else:
        out["pretrain"] = _load_external("pretrain", cfg.pretrain, cfg.seed, cfg.heldout_fraction)
    out["preference"] = (synthetic.preference_pairs(cfg.preference_pairs, cfg.heldout_fraction, rng)
                         if cfg.preference.kind == "synthetic"
                         else _load_external("preference", cfg.preference, cfg.seed, cfg.heldout_fraction))
    out["sft"] = (synthetic.sft_examples(cfg.sft_examples, cfg.heldout_fraction, cfg.label_noise, rng)
                  if cfg.sft.kind == "synthetic"
                  else _load_external("sft", cfg.sft, cfg.seed, cfg.heldout_fraction))
    return out


def _texts(sets: dict[str, tuple[list, list]]):
    for name, (train, held) in sets.items():
        for row in train + held:
            yield " ".join(str(row[c]) for c in COLUMNS[name])


def write_data(ctx: StageContext, cfg: DataConfig) -> tuple[Path, dict]:
    import datasets

    out = ctx.work_dir
    sets = build_datasets(cfg)
    info: dict = {}
    for name, (train, held) in sets.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        info[name] = {}
        for split, rows in (("train", train), ("heldout", held)):
            path = out / name / f"{split}.jsonl"
            datasets.Dataset.from_list(rows).to_json(str(path), lines=True, force_ascii=False)
            info[name][split] = {"path": f"{name}/{split}.jsonl", "rows": len(rows), "sha256": mf.sha256_file(path)}
    tok = train_tokenizer(_texts(sets), ctx.model["vocab_size"], out / "tokenizer")
    info["tokenizer"] = {"vocab_size": len(tok), "path": "tokenizer"}
    return out, info


# log_prints off: dill (under `datasets`) finds globals by capturing print() from dis.dis; Prefect would log every
# bytecode line instead (and dill would see none).
@task(name="data", cache_policy=NO_CACHE, log_prints=False)
def run_data(ctx: StageContext, cfg: DataConfig) -> StageOutput:
    out, info = write_data(ctx, cfg)
    write_lm_eval_task(out)
    m = mf.build(out, format="dataset", stage="data", engine={"name": "datasets", **mf.engine_versions("datasets", "tokenizers")},
                 extra={"datasets": {k: v for k, v in info.items() if k != "tokenizer"}, "revision": cfg.revision,
                        "vocab_size": info["tokenizer"]["vocab_size"]},
                 tokenizer_dir=out / "tokenizer")
    mf.write(out, m)
    if ctx.mlflow_run_id:
        c = tracking.client()
        for name in ("pretrain", "preference", "sft"):
            for split in ("train", "heldout"):
                d = info[name][split]
                tracking.log_dataset(c, ctx.mlflow_run_id, out / d["path"], f"{name}-{split}",
                                     "training" if split == "train" else "evaluation", d["sha256"])
    metrics = {f"{n}_{s}_rows": info[n][s]["rows"] for n in ("pretrain", "preference", "sft") for s in ("train", "heldout")}
    metrics["vocab_size"] = info["tokenizer"]["vocab_size"]
    from conversions.verify import integrity

    gate = {"passed": True, "checks": integrity(out)}
    gate["passed"] = all(c["passed"] for c in gate["checks"])
    return StageOutput(output=out, engine="datasets", backend="synthetic" if cfg.pretrain.kind == "synthetic" else "files",
                       gate=gate, metrics=metrics)
