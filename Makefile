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

.PHONY: setup system-deps runtimes lock demo test test-fast clean up down

# The main venv: an overlay over the cached runtime built from infra/runtimes/main.txt (see infra/runtimes/build.py).
setup: $(VENV)/.baton-overlay

$(VENV)/.baton-overlay: infra/runtimes/main.txt infra/runtimes/main.lock infra/runtimes/build.py
	$(PYTHON) infra/runtimes/build.py main --overlay $(VENV) >/dev/null

# Debian packages engines build against: libaio-dev for DeepSpeed's async I/O op (ZeRO-Infinity NVMe offload).
# A quick no-op when installed; needs root or sudo otherwise.
system-deps:
	@bash infra/stack/system-deps.sh libaio-dev

# Engine runtimes whose pins conflict with the main venv (serving). Built once per requirements digest.
runtimes: setup
	@for rt in $$(ls infra/runtimes/*.txt | xargs -n1 basename | sed 's/\.txt$$//' | grep -v '^main$$'); do \
		$(PYTHON) infra/runtimes/build.py $$rt >/dev/null || exit 1; done

# Regenerate every runtime's hash-locked set from its .txt (pip's resolver with this machine's pip configuration).
lock:
	$(PYTHON) infra/runtimes/lock.py $$(ls infra/runtimes/*.txt | xargs -n1 basename | sed 's/\.txt$$//')

demo: setup runtimes
	$(VENV)/bin/baton run configs/tiny.yaml

test: setup system-deps runtimes
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The inner loop: config, planning, conversions and checks that start no engine, server or cluster (~1-2 min).
test-fast: setup
	$(VENV)/bin/python -m pytest -m fast -p no:cacheprovider $(PYTEST_ARGS)

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
