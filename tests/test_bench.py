"""The pieces of `make bench` that decide its verdicts: the growth exponent, the read-bandwidth ceiling and the
docs performance table (docs/performance.md) it regenerates."""
from __future__ import annotations

import json
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


def test_the_converters_imports_are_taken_out_of_its_work():
    samples = {"read_cold": [{"seconds": 2.0}], "read_warm": [{"seconds": 1.0}],
               "baton_cold": [{"seconds": 1.0, "rss_mb": 400.0}], "baton_warm": [{"seconds": 0.5, "rss_mb": 600.0}],
               "imports": [{"seconds": 0.25, "rss_mb": 500.0}], "dcp-naive": [{"seconds": 2.0, "rss_mb": 2000.0}],
               "write": [{"seconds": 0.125}]}
    r = bench.summarize("megatron-tp1", samples, params=10**8, largest=100 << 20, files_bytes=4 * 10**9,
                        needed_bytes=10**9, other="dcp-naive")
    assert r["baton_warm"]["fraction_of_read_bandwidth"] == 0.5
    assert r["baton_warm"]["work_seconds"] == 0.25 and r["baton_warm"]["work_fraction_of_read_bandwidth"] == 1.0
    # reading 1 GB at 4 GB/s (0.25 s) and writing it (0.125 s): 0.375 s of I/O in 0.5 s, or in 0.25 s of work
    assert r["write"]["gb_per_s"] == 8.0
    assert r["baton_warm"]["fraction_of_io_ceiling"] == 0.75 and r["baton_warm"]["work_fraction_of_io_ceiling"] == 1.5
    line = bench.targets([{"size": "S", "format": "megatron-tp1", **r}])
    assert "end to end missed by S megatron-tp1 50%" in line and "after the converter's imports met by all" in line
    assert "missed by S megatron-tp1 600 > 450 MB" in line and "above the imports' own RSS met by all" in line


def _stats(x: float) -> dict:
    return {"median": x, "min": x, "max": x, "n": 1}


def test_overhead_reads_the_engine_wall_and_step_times_the_stage_left(tmp_path):
    import overhead_bench as ob
    from tasks import events
    from tasks.streaming import ENGINE_WALL

    log = tmp_path / "step.log"
    log.write_text(f'10:00:01 INFO    prefect.task_runs: {ENGINE_WALL} {{"name": "rlhf-trl-dpo", "seconds": 12.5}}\n'
                   f'10:00:09 INFO    prefect.task_runs: {ENGINE_WALL} {{"name": "lm-eval-gate", "seconds": 3.0}}\n')
    assert ob.engine_wall(log, "rlhf") == 12.5 and ob.engine_wall(log, "lm-eval") == 3.0
    assert ob.engine_wall(log, "finetune") is None
    lines = [events.PREFIX + '{"kind": "metric", "step": 1, "perf/step_time_s": 0.5}', "plain log line",
             events.PREFIX + '{"kind": "metric", "step": 1, "train/loss": 2.0}',
             events.PREFIX + '{"kind": "progress", "step": 1, "total": 2}']
    assert ob.step_times(lines) == [0.5]
    assert ob.stats([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert ob.stats([None]) is None


def test_overhead_verdict_and_table():
    import overhead_bench as ob

    row = {"baton_step_s": _stats(60.0), "baton_engine_s": _stats(52.0), "bare_worker_s": _stats(50.0),
           "stage_bookkeeping_s": _stats(8.0), "ratio": _stats(1.2), "engine_ratio": _stats(1.04),
           "per_step_overhead_s": _stats(0.2), "per_step_overhead": _stats(0.4),
           "median_step_time_baton_s": _stats(0.5), "median_step_time_bare_s": _stats(0.5), "step_time_ratio": _stats(1.0)}
    long = {**row, "steps": 100, "reps": 2, "per_step_overhead": _stats(0.02)}
    res = {"profile": "quick", "machine_at_start": {"cores": 2, "load_average": [3.0, 2.0, 1.0]},
           "pipeline": {"steps": {"pretrain": 10, "rlhf": 4, "finetune": 10}, "reps": 1, "baton_wall_s": _stats(600.0),
                        "startup_s": _stats(60.0), "steps_total_s": _stats(500.0), "flow_bookkeeping_s": _stats(40.0),
                        "training_stages_ratio": _stats(1.1), "whole_run_ratio": _stats(1.5),
                        "stages": {"pretrain": row, "rlhf": row, "finetune": row}},
           "long_pretrain": long}
    res["verdict"] = ob.verdict(res)
    # a short stage's amortized overhead is start-up jitter over a few steps: reported, judged only in the long run
    assert all(v["met"] for v in res["verdict"]["stages"].values())
    res["long_pretrain"] = {**long, "per_step_overhead": _stats(0.08)}
    res["verdict"] = ob.verdict(res)
    assert not res["verdict"]["stages"]["pretrain_long"]["met"]
    text = "\n".join(bench.overhead_lines(res))
    assert "| pretrain ×10 (alternating, 2 reps) | 100 |" in text and "+8.0%" in text
    assert "missed by pretrain_long (step time ×1.00, per-step overhead +8.0%)" in text and "start-up 60 s" in text


def test_work_left_within_the_noise_of_the_imports_is_not_judged():
    samples = {"read_cold": [{"seconds": 2.0}], "read_warm": [{"seconds": 1.0}],
               "baton_cold": [{"seconds": 4.0, "rss_mb": 400.0}], "baton_warm": [{"seconds": 3.7, "rss_mb": 400.0}],
               "imports": [{"seconds": 3.8, "rss_mb": 300.0}], "dcp-naive": [{"seconds": 4.0, "rss_mb": 900.0}],
               "write": [{"seconds": 0.2}]}
    r = bench.summarize("megatron-tp1", samples, params=10**7, largest=1 << 20, files_bytes=10**9,
                        needed_bytes=10**8, other="dcp-naive")
    assert r["baton_warm"]["work_seconds"] is None and r["baton_warm"]["work_fraction_of_io_ceiling"] is None
    line = bench.targets([{"size": "S", "format": "megatron-tp1", **r}])
    assert "after the converter's imports met by all (not judged: S megatron-tp1, whose imports" in line


def test_every_metric_the_bench_logs_follows_the_naming_scheme():
    from tasks import events

    conv = {"size": "M", "format": "megatron-tp2pp2"}
    keys, quantities = ("read_cold", "read_warm", "write", "baton_cold", "baton_warm", "dcp-naive"), \
        ("bytes_per_s", "s", "peak_rss_mib")
    names = {bench.perf_name(conv, key, quantity) for key in keys for quantity in quantities}
    assert len(names) == len(keys) * len(quantities)  # no two measurements share a metric
    assert "perf/m_megatron_tp2pp2_dcp_naive_peak_rss_mib" in names and "perf/m_megatron_tp2pp2_write_s" in names
    assert all(events.name_problem(n) is None for n in names)
    with pytest.raises(ValueError, match="metric name"):  # the check that guards them can refuse a name
        events.checked("perf/M_megatron-tp2pp2_write_s")


def test_the_gates_levels_are_reported_against_their_step():
    p = {"facts": [{"steps_s": {"convert": 12.3}, "verification_s": {"convert": {"L0": 0.1, "L1": 2.0}}}]}
    assert bench.verification_lines(p)[-1].endswith("convert L0 0.1, L1 2.0 s of its 12 s.")
    assert bench.verification_lines({"facts": [{}]}) == []


def test_the_import_column_says_whether_megatron_to_hf_imports_torch_distributed_checkpoint(tmp_path):
    """Measured in the converter's own process: baton's torch_dist reader leaves torch.distributed.checkpoint (whose
    loader unpickles `.metadata` with plain pickle) unimported; DCP's own converter, the control, imports it."""
    from test_hostile_loader import _dist_checkpoint

    src = _dist_checkpoint(tmp_path / "ckpt")
    ours, theirs = (bench.run_converter(which, src, tmp_path / which) for which in ("baton-megatron", "dcp-naive"))
    assert ours["dcp"] is False and theirs["dcp"] is True
    samples = {"read_cold": [{"seconds": 2.0}], "read_warm": [{"seconds": 1.0}], "baton_cold": [ours],
               "baton_warm": [ours], "dcp-naive": [theirs]}
    r = bench.summarize("megatron-tp1", samples, params=10**3, largest=1 << 10, files_bytes=10**6, needed_bytes=10**6,
                        other="dcp-naive")
    assert bench._dcp({"format": "megatron-tp1", **r}) == " (no torch.distributed.checkpoint)"
    assert r["dcp-naive"]["imported_dcp"] is True


def test_real_model_bench_reads_each_steps_last_report_and_judges_throughput_after_warm_up():
    import real_model_bench as rb
    from tasks import events

    lines = ["[rank0] not an event", events.PREFIX + '{"kind": "progress", "step": 1, "total": 3}'] + [
        events.PREFIX + json.dumps({"kind": "metric", "step": s, events.TOKENS_PER_S: v})
        for s, v in ((2, 90.0), (1, 10.0), (3, 100.0), (2, 95.0))]
    assert rb.step_series(lines, events.TOKENS_PER_S) == [10.0, 95.0, 100.0]
    assert rb.step_series(lines, events.STEP_TIME_S) == []
    tokens = rb.compare([10.0, 95.0, 100.0, 80.0], [50.0, 100.0, 100.0, 120.0], higher_is_better=True)
    assert tokens["baton_median"] == 95.0 and tokens["bare_median"] == 100.0  # the first step is left out
    assert tokens["ratio"] == 0.95 and tokens["met"] and tokens["steps_compared"] == 3
    times = rb.compare([9.0, 2.0, 2.5], [1.0, 2.0, 2.0], higher_is_better=False)
    assert times["ratio"] == 0.8889 and times["met"] is False
    assert rb.compare([1.0], [1.0], higher_is_better=True)["ratio"] is None
    assert rb.rates([100.0, 250.0, 300.0], [2.0, 3.0, 0.5]) == [50.0, 50.0, 100.0]  # TRL's count is cumulative
    for stage in rb.STAGES:
        for key in ("baton_median", "bare_median", "ratio"):
            events.checked(f"perf/real_{stage}_{key}")


def test_real_model_bench_dpo_batch_puts_chosen_rows_first_right_padded():
    import real_model_bench as rb

    ids, att, comp = rb.dpo_batch([(([5, 6, 7], [0, 1, 1]), ([5, 8], [0, 1]))], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [5, 8, 0]]
    assert att.tolist() == [[1, 1, 1], [1, 1, 0]] and comp.tolist() == [[0, 1, 1], [0, 1, 0]]


def test_real_model_bench_splits_baton_vs_bare_into_orchestration_and_engine():
    import real_model_bench as rb
    from tasks import events

    def lines(step_times):  # TRL's running token count: 100 tokens a step
        return [events.PREFIX + json.dumps({"kind": "metric", "step": i + 1, rb.NUM_TOKENS: 100.0 * (i + 1),
                                            events.STEP_TIME_S: t}) for i, t in enumerate(step_times)]

    bare = {"tokens_per_s": [10.0, 50.0, 50.0], "cpu_s": [3.0, 2.0, 2.0], "mean_tokens_per_step": 100.0, "pairs": 8}
    row = rb.stage_row("rlhf", lines([9.0, 2.5, 2.5]), lines([9.0, 2.0, 2.0]), bare)
    assert row["baton_series"] == [11.11, 40.0, 40.0] and row["ratio"] == 0.8 and row["met"] is False
    assert row["baton_vs_engine_alone"] == 0.8 and row["engine_alone_vs_bare"] == 1.0


def test_the_like_for_like_serving_contender_takes_baton_s_engine_settings_only(tmp_path):
    """bare-same = `vllm serve` plus what changes the computation in baton's command (dtype, eager, length), never
    its orchestration flags (API key, served name, structured-output backend)."""
    import serve_bench
    from tasks.serve import engines
    from tasks.serve.config import ServeConfig

    cmd, _ = engines.vllm_command(ServeConfig(engine="vllm", device="cpu", max_model_len=256), "python", tmp_path,
                                  8000, "baton", "key")
    assert serve_bench.same_engine_flags(cmd) == ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]
