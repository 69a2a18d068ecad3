# Two commands for a newcomer: `make demo` (the main job) and `make test` (the suite .ci/run calls).
# Both create the virtual environment on first use from the pinned lock file.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One pytest worker per core (pytest-xdist), each running whole test files: a file's module
# fixtures (a ledger server, a compiled job's first run) stay in one worker.
PARALLEL := -n auto --dist loadfile

.PHONY: demo taxi-statistics taxi-stream taxi-workloads ledger-demo test test-quick browser mariadb web benchmark \
	mutation breaks lock clean

$(STAMP): requirements/lock.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==24.3.1 setuptools==75.8.0 wheel==0.45.1
	# Every package is pinned in the lock file, so no resolver runs: a fresh machine gets this exact set.
	$(BIN)/pip install --quiet --no-deps -r requirements/lock.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The ledger page's chart library (plotly.js's basic bundle) from the npm registry, exactly as
# sage_access/web/package-lock.json pins it, served by `sage-tfx ledger serve` (no CDN).
WEB_ASSETS := sage_access/web/node_modules/.package-lock.json
$(WEB_ASSETS): sage_access/web/package-lock.json
	cd sage_access/web && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $(WEB_ASSETS)

web: $(WEB_ASSETS)

demo: $(STAMP)
	$(BIN)/python -m sage_tfx.examples.taxi.run --workdir out/taxi-demo

# DP statistics per community area (issue 18): `sage-tfx ingest` then `sage-tfx query`. The tfx
# sample has no taxi id, so each trip is its own unit here (examples/taxi/statistics.py).
taxi-statistics: $(STAMP)
	$(BIN)/python -m sage_tfx.examples.taxi.statistics --workdir out/taxi-statistics \
		--unit-column trip_id

# The taxi trips replayed as a stream (issue 19): a DP count per community area 48 times over
# 2013-2016 for one grant (`sage-tfx stream`; docs/streaming.md). Unit trip_id, as taxi-statistics.
taxi-stream: $(STAMP)
	$(BIN)/python -m sage_tfx.examples.taxi.continual --workdir out/taxi-stream

# The taxi workloads by the matrix mechanism (issue 20): duration ranges and the 2-way marginals
# of (hour, community area, payment type), from the ingested trips (examples/taxi/workloads).
taxi-workloads: $(STAMP)
	$(BIN)/python -m sage_tfx.examples.taxi.workload_answers --workdir out/taxi-workloads

ledger-demo: $(STAMP) $(WEB_ASSETS)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/ledger_demo.sh

test: $(STAMP) $(WEB_ASSETS) browser mariadb
	$(BIN)/python -m pytest tests $(PARALLEL)

# Debian's Chromium and its driver, for the ledger page's browser tests (tests/sage_access): when
# they are missing and we may install them (root, apt-get); otherwise those tests skip, saying why.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver >/dev/null) \
	    || echo "make browser: apt-get could not install chromium: the browser tests will skip"; \
	  else echo "make browser: not root or no apt-get: the browser tests will skip"; fi; \
	fi

# Debian's MariaDB server, for the ledger tests on a shared database (tests/support/mariadb.py starts
# a throwaway server per session): installed when missing and we may (root, apt-get); otherwise
# those tests skip, saying why.
mariadb:
	@if ! command -v mariadbd >/dev/null && [ ! -x /usr/sbin/mariadbd ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends mariadb-server >/dev/null) \
	    || echo "make mariadb: apt-get could not install mariadb-server: the MariaDB tests will skip"; \
	  else echo "make mariadb: not root or no apt-get: the MariaDB tests will skip"; fi; \
	fi

# During development: the suite without the tests marked slow (TFX pipelines, several processes,
# crashes, minutes of sampling). CI runs `make test`, the whole suite.
test-quick: $(STAMP) $(WEB_ASSETS) browser mariadb
	$(BIN)/python -m pytest tests -m "not slow" $(PARALLEL)

benchmark: $(STAMP) $(WEB_ASSETS)
	# PipelineDP, the anchor of benchmarks/aggregation.py, is pinned apart from the lock.
	$(BIN)/pip install --quiet --no-deps -r requirements/benchmark.txt
	$(BIN)/python benchmarks/ledger.py --backend sqlite --json
	$(BIN)/python benchmarks/ledger.py --backend mysql --json
	$(BIN)/python benchmarks/ledger_web.py
	$(BIN)/python benchmarks/oblivious_sampling.py --n 1000000 --json
	$(BIN)/python benchmarks/dp_training.py --rows 100000 --json
	$(BIN)/python benchmarks/digits_table2.py --json
	$(BIN)/python benchmarks/slaed_table2.py --json
	$(BIN)/python benchmarks/taxi_sample_complexity.py --json
	$(BIN)/python benchmarks/workload.py --json
	$(BIN)/python benchmarks/noise.py --json
	$(BIN)/python benchmarks/kubeflow_local.py
	$(BIN)/python benchmarks/audit.py --json
	$(BIN)/python benchmarks/aggregation.py --rows 1000000 --json
	$(BIN)/python benchmarks/streaming.py --json
	$(BIN)/python benchmarks/streaming.py --micro-batches 1000 --baseline-1-final-only --json
	$(BIN)/python benchmarks/streaming.py --latency --json

# Mutation testing of the privacy-critical modules (docs/mutation.md), by hand, not in CI. The tool
# is pinned apart from the lock (requirements/mutation.txt) so CI never installs it.
# `make mutation ARGS="--only slaed --max-mutants 0"` runs one module, unsampled.
mutation: $(STAMP)
	$(BIN)/pip install --quiet --no-deps -r requirements/mutation.txt
	$(BIN)/python mutation/run.py $(ARGS)

# The release rules' deliberate breaks (docs/mutation.md): each must fail its behavioural tests.
# Needs no extra tool; by hand (22 breaks, 14 minutes at load 6-10 on 2 shared cores), not in CI.
breaks: $(STAMP)
	$(BIN)/python mutation/breaks.py $(ARGS)

# Regenerate the lock from requirements/direct.txt and requirements/nodeps.txt (needs the registry).
lock:
	rm -rf .lockenv && $(PYTHON) -m venv .lockenv
	.lockenv/bin/pip install --quiet pip==24.3.1
	.lockenv/bin/pip install --quiet -r requirements/direct.txt
	.lockenv/bin/pip install --quiet --no-deps -r requirements/nodeps.txt
	.lockenv/bin/pip freeze --exclude-editable > requirements/lock.txt
	rm -rf .lockenv

clean:
	rm -rf $(VENV)
