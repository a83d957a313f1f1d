"""The pieces of `make bench` that decide its verdicts: the growth exponent, the read-bandwidth ceiling and the
README table it regenerates."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench  # noqa: E402

pytestmark = pytest.mark.fast


def test_exponent_of_linear_and_quadratic_growth():
    assert bench.exponent([(1e8, 2.0), (3e8, 6.0), (1e9, 20.0)]) == 1.0
    assert bench.exponent([(1.0, 1.0), (2.0, 4.0), (4.0, 16.0)]) == 2.0
    assert bench.exponent([(1.0, 1.0)]) is None


def test_cold_and_warm_reads_cover_every_byte(tmp_path):
    files = [tmp_path / f"f{i}" for i in range(3)]
    for f in files:
        f.write_bytes(os.urandom(1 << 20))
    bench.drop_cache(files)
    assert bench.read_all(files) > 0
    assert bench.checkpoint_files(tmp_path) == files


def test_fraction_of_read_bandwidth_compares_needed_bytes(tmp_path):
    samples = {"read_cold": [{"seconds": 2.0}], "read_warm": [{"seconds": 1.0}],
               "baton_cold": [{"seconds": 1.0, "rss_mb": 400.0}], "baton_warm": [{"seconds": 0.5, "rss_mb": 400.0}],
               "deepspeed": [{"seconds": 2.0, "rss_mb": 2000.0}]}
    r = bench.summarize("zero2", samples, params=10**8, largest=100 << 20, files_bytes=4 * 10**9,
                        needed_bytes=10**9, other="deepspeed")
    assert r["read_warm"]["gb_per_s"] == 4.0 and r["baton_warm"]["gb_per_s"] == 2.0
    assert r["baton_warm"]["fraction_of_read_bandwidth"] == 0.5  # 1 GB at 4 GB/s is 0.25 s; it took 0.5 s
    assert r["baton_warm"]["rss_over_largest_tensor"] == 4.0 and r["baton_warm"]["rss_target_mb"] == 450.0
