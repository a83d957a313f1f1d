"""The example stage's Prefect task: what it reads (the data stage's manifest), its gate and its metrics."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import manifest as mf
from conversions.verify import check, report
from tasks.stage import StageContext, StageOutput


@task(name="example", cache_policy=NO_CACHE)
def run_example(ctx: StageContext, cfg) -> StageOutput:
    datasets = (mf.read(ctx.data_dir) or {}).get("extra", {}).get("datasets", {})
    rows = {name: info["train"]["rows"] for name, info in sorted(datasets.items())}
    checks = [check(f"example.{name}", n >= cfg.min_rows, f"{n} training rows, needs {cfg.min_rows}")
              for name, n in rows.items()]
    return StageOutput(output=None, engine="example", gate=report(checks),
                       metrics={f"{name}_train_rows": n for name, n in rows.items()})
