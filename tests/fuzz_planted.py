"""Deliberately broken readers for benchmarks/fuzz.py's --reader: the fuzz must fail on each (tests/test_fuzz.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fuzz  # noqa: E402


def careless_reader(fmt: str, folder: Path):
    """baton's readers, but safetensors files go through numpy (a bare ValueError from numpy.lib.format on every one)
    and a seal is trusted without looking at its bytes."""
    if fmt == "safetensors":
        with open(folder / "model.safetensors", "rb") as f:
            np.lib.format.read_array(f)
    if fmt == "seal":
        return "loaded", None
    return fuzz.load_case(fmt, folder)
