"""Read one configured source (local files or a hub dataset) into (location, raw row) pairs, then validate and
normalise it (tasks/data/formats.py). Locations name the file and line (jsonl, .txt/.md), the item (json array) or
the row (parquet, hub), so a bad row is reported as `train.jsonl:7`."""
from __future__ import annotations

import glob
import itertools
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from conversions.refusal import Refused
from tasks.data import formats
from tasks.data.config import SourceConfig

TEXT_SUFFIXES = (".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
PARQUET_SLICE = 1024  # rows turned into Python objects at a time


class DataError(Refused):
    """Bad input data: the message names the file, line and field."""


@dataclass
class Loaded:
    format: str
    rows: list[dict] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)
    first_problem: formats.Problem | None = None
    read: int = 0
    capped: bool = False              # max_rows reached: the rest of the source was not read
    files: list[str] = field(default_factory=list)


def matched_files(pattern: str) -> list[Path]:
    """A glob, a file, or a folder (every .jsonl/.json/.parquet/.txt/.md below it), sorted."""
    p = Path(pattern)
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in ROW_SUFFIXES + TEXT_SUFFIXES)
    return sorted(Path(f) for f in glob.glob(pattern, recursive=True) if Path(f).is_file())


def _paragraphs(path: Path) -> Iterator[tuple[str, dict]]:
    """A .txt/.md file: one document per blank-line-separated paragraph, located at its first line."""
    buf: list[str] = []
    start = 1
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            if not buf:
                start = n
            buf.append(line)
        elif buf:
            yield f"{path}:{start}", {"text": "\n".join(buf)}
            buf = []
    if buf:
        yield f"{path}:{start}", {"text": "\n".join(buf)}


def _file_rows(path: Path) -> Iterator[tuple[str, object]]:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:  # line by line: max_rows stops the read
            for n, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f"{path}:{n}", formats.Problem(f"{path}:{n}", "(line)", "invalid_json", str(e))
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows (use .jsonl for one row per line)")
        for i, row in enumerate(data, start=1):
            yield f"{path}:item {i}", row
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path)
    elif path.suffix in TEXT_SUFFIXES:
        yield from _paragraphs(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (.jsonl, .json, .parquet, .txt, .md)")


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    """One row group at a time, in slices of PARQUET_SLICE rows: a source that stops at max_rows never reads (or
    decompresses) the row groups after it."""
    import pyarrow.parquet as pq

    n = 0
    with pq.ParquetFile(path) as pf:
        for group in range(pf.num_row_groups):
            for batch in pf.read_row_group(group).to_batches(max_chunksize=PARQUET_SLICE):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{path}:row {n}", row


def file_rows(pattern: str, key: str, kind: str) -> tuple[list[Path], Iterator[tuple[str, object]]]:
    files = matched_files(pattern)
    if not files:
        raise DataError(f"{key}: no files match {pattern!r}")
    if kind != "pretrain":
        texts = [f for f in files if f.suffix in TEXT_SUFFIXES]
        if texts:
            raise DataError(f"{key}: {texts[0]} is plain text; only pretraining reads .txt/.md "
                            "(use .jsonl, .json or .parquet rows)")

    def rows():
        for f in files:
            yield from _file_rows(f)

    return files, rows()


def hub_rows(src: SourceConfig, split: str, key: str) -> Iterator[tuple[str, object]]:
    """A hub dataset split through `datasets` (config name and revision pinned); offline → one message."""
    import datasets

    try:
        ds = datasets.load_dataset(src.train, src.name, split=split, revision=src.revision)
    except Exception as e:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        offline = any(os.environ.get(v) == "1" for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        hint = ("offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and it is not in the local cache"
                if offline else "no network or not found, and not in the local cache")
        raise DataError(f"{key}: hub dataset {src.train!r} (config {src.name}, revision {src.revision or 'main'}, "
                        f"split {split!r}) could not be loaded: {hint} [{type(e).__name__}: {str(e)[:200]}]") from None
    for i, row in enumerate(ds, start=1):
        yield f"{src.train}[{split}]:row {i}", row


def _peek(rows: Iterator, n: int = 50) -> tuple[list, set[str]]:
    head, cols = [], set()
    for item in rows:
        head.append(item)
        if isinstance(item[1], dict):
            cols |= set(item[1])
        if len(head) >= n:
            break
    return head, cols


def resolve_format(kind: str, src: SourceConfig, columns: set[str], key: str, where: str) -> str:
    if src.format != "auto":
        if formats.kind_of(src.format) != kind:
            raise DataError(f"{key}.format: {src.format!r} is not a {kind} format "
                            f"({', '.join(formats.FORMATS[kind])})")
        return src.format
    fmt = formats.detect(kind, columns, src.columns)
    other = next(((k, f) for k in formats.FORMATS if k != kind
                  for f in [formats.detect(k, columns, src.columns)] if f), None)
    if fmt is None and other:  # e.g. SFT rows in a preference list: never guessed into the wrong form
        raise DataError(f"{key}: {where} holds {other[0]} data ({other[1]} columns {sorted(columns)}), "
                        f"not {kind} data; data.{kind} takes only {', '.join(formats.FORMATS[kind])}")
    if fmt is None:
        known = "; ".join(f"{n}: {', '.join(r)}" for n, r in formats.FORMATS[kind].items())
        raise DataError(f"{key}: cannot tell the format of {where} from its columns {sorted(columns)} ({known}); "
                        f"set {key}.format and, where the names differ, {key}.columns")
    return fmt


def load(kind: str, src: SourceConfig, split_name: str, key: str, fmt: str | None = None) -> Loaded:
    """Read, detect, validate and normalise one split of one source; bad rows are counted, not raised. Training rows
    stop at the source's max_rows valid ones (in file order)."""
    if src.kind == "hub":
        files, rows = [], hub_rows(src, src.split if split_name == "train" else src.heldout, key)
        origin = src.train
    else:
        files, rows = file_rows(src.train if split_name == "train" else src.heldout, key, kind)
        origin = str(files[0])
    head, cols = _peek(rows)
    if not head:
        raise DataError(f"{key}: no rows ({', '.join(map(str, files)) or origin})")
    fmt = fmt or resolve_format(kind, src, cols, key.rsplit(".", 1)[0], origin)  # hints name data.sft, not .train
    out = Loaded(format=fmt, files=[str(f) for f in files])
    cap = src.max_rows if split_name == "train" else None
    for where, raw in itertools.chain(head, rows):
        if cap is not None and len(out.rows) >= cap:
            out.capped = True
            break
        out.read += 1
        problem = raw if isinstance(raw, formats.Problem) else None
        row = None
        if problem is None:
            row, problem = formats.normalise(fmt, raw, src.columns, where)
        if problem is not None:
            out.bad[problem.reason] += 1
            out.first_problem = out.first_problem or problem
        else:
            out.rows.append(row)
    return out


def check_quality(loaded: Loaded, key: str, max_bad_fraction: float) -> None:
    bad = sum(loaded.bad.values())
    if loaded.read and bad / loaded.read > max_bad_fraction:
        counts = ", ".join(f"{r.replace('_', ' ')} {n}" for r, n in loaded.bad.most_common())
        raise DataError(f"{key}: {loaded.first_problem.message()} — {bad} of {loaded.read} rows bad ({counts}); "
                        f"data.max_bad_fraction is {max_bad_fraction}")
    if not loaded.rows:
        raise DataError(f"{key}: no rows ({', '.join(loaded.files) or 'empty split'})")


def split_heldout(rows: list[dict], fraction: float, seed: int, key: str) -> tuple[list[dict], list[dict]]:
    if len(rows) < 2:
        raise DataError(f"{key}: {len(rows)} row(s) cannot be split into train and held-out; give {key}.heldout")
    rows = rows[:]
    random.Random(seed).shuffle(rows)
    k = min(len(rows) - 1, max(1, int(len(rows) * fraction)))
    return rows[k:], rows[:k]
