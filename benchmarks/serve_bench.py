"""Serving benchmark: baton-managed vLLM vs a bare `vllm serve` of the same checkpoint, in one run.

    .venv/bin/python benchmarks/serve_bench.py CHECKPOINT [--requests 32] [--concurrency 8] [--max-tokens 64]

Each server is started, warmed up with one request, then sent N streamed completions from C concurrent clients
(EOS ignored, so every request decodes max_tokens). Reports throughput (tokens/s, requests/s), TTFT and latency
p50/p95 for both, and the baton/bare throughput ratio; logs them to MLflow (experiment `baton-bench`) and prints
JSON. Servers run one at a time and only on 127.0.0.1; every loop is bounded by N and by timeouts.

"baton" = the stage's flags (CPU: --enforce-eager, guidance structured outputs, API key); "bare" = `vllm serve CKPT`
with nothing but the port (and on CPU the KV-cache size vLLM refuses to start without): what typing `vllm serve`
gives; "bare-same" = that plus the flags of baton's command that change what the engine computes (its dtype,
--enforce-eager, --max-model-len), so baton/bare-same is what the orchestration itself costs. `--contenders` picks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tasks.runtimes import python_for  # noqa: E402
from tasks.serve import engines  # noqa: E402
from tasks.serve.config import ServeConfig  # noqa: E402
from tasks.serve.server import Server, free_port, redactor  # noqa: E402

PROMPTS = ["the apple is a", "a tiger is one kind of", "every city list has", "alice said that the", "the blue is"]


def one_request(base_url: str, key: str | None, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with requests.post(f"{base_url}/v1/completions", json=body, headers=headers, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "latency": time.perf_counter() - t0,
            "tokens": tokens}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def load_test(base_url: str, key: str | None, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    one_request(base_url, key, model, PROMPTS[0], 8)  # warm-up, not measured
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_request(base_url, key, model, PROMPTS[i % len(PROMPTS)], max_tokens),
                                range(n)))
    wall = time.perf_counter() - t0
    ttft, lat = [r["ttft"] for r in results], [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": n, "concurrency": concurrency, "wall_s": wall, "tokens": tokens,
            "throughput_tok_s": tokens / wall, "requests_per_s": n / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 95),
            "latency_p50_s": statistics.median(lat), "latency_p95_s": pct(lat, 95)}


def run_server(label: str, cmd: list[str], env: dict, base_url: str, key: str | None, model: str, args,
               log_dir: Path) -> dict:
    server = Server(label, cmd, env, base_url, log_dir / f"{label}.log", redactor(key or ""))
    server.start()
    try:
        startup = server.wait_healthy(args.health_timeout)
        res = load_test(base_url, key, model, args.requests, args.concurrency, args.max_tokens)
        res["startup_s"] = startup
        return res
    finally:
        server.stop()


# flags of baton's engine command that change the computation, not the orchestration (value-taking ones first)
SAME_ENGINE_FLAGS = {"--dtype": True, "--max-model-len": True, "--enforce-eager": False}


def same_engine_flags(baton_cmd: list[str]) -> list[str]:
    """The SAME_ENGINE_FLAGS baton's command carries, with their values, in its order."""
    out = []
    for i, arg in enumerate(baton_cmd):
        if arg in SAME_ENGINE_FLAGS:
            out += [arg, baton_cmd[i + 1]] if SAME_ENGINE_FLAGS[arg] else [arg]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--health-timeout", type=float, default=600)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--contenders", default="baton,bare,bare-same", help="of baton, bare, bare-same (baton always runs)")
    args = ap.parse_args()
    ckpt = args.checkpoint.resolve()
    python = python_for("vllm")
    log_dir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    cfg = ServeConfig(engine="vllm", device=args.device)
    key = "bench-" + os.urandom(12).hex()
    results: dict = {}

    port = free_port(cfg.host)
    cmd, env = engines.vllm_command(cfg, python, ckpt, port, "baton", key)
    results["baton"] = run_server("baton", cmd, env, f"http://127.0.0.1:{port}", key, "baton", args, log_dir)

    bare_env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if args.device == "cpu" else {}
    for label, extra in (("bare", []), ("bare-same", same_engine_flags(cmd))):
        if label not in args.contenders.split(","):
            continue
        port = free_port(cfg.host)
        bare = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(ckpt), "--host", "127.0.0.1", "--port",
                str(port), *extra]
        results[label] = run_server(label, bare, bare_env, f"http://127.0.0.1:{port}", None, str(ckpt), args, log_dir)
        results[label]["flags"] = extra
        results[f"ratio_vs_{label}"] = {k: results["baton"][k] / results[label][k] for k in
                                        ("throughput_tok_s", "ttft_p50_s", "latency_p50_s", "startup_s")
                                        if results[label][k]}
    results["logs"] = str(log_dir)
    if not args.no_mlflow:
        from tasks import tracking

        c = tracking.client()
        run = tracking.start_run(c, "baton-bench", f"serve-bench-{ckpt.name}", tags={"benchmark": "serve"})
        tracking.log_params(c, run, {"checkpoint": str(ckpt), "requests": args.requests,
                                     "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                                     "device": args.device})
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        sides = [side for side in results if side not in ("logs",)]
        c.log_batch(run, metrics=[Metric(f"{side}.{k}", float(v), now, 0) for side in sides
                                  for k, v in results[side].items() if isinstance(v, (int, float))])
        tracking.end_run(c, run, True)
        results["mlflow_run_id"] = run
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
