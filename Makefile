# kvsched — the two Quick-start commands (`make demo`, `make test`) set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba-cache

.PHONY: demo gateway-demo test test-fast lint typecheck bench bench-quick install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,gateway]'
	touch $(STAMP)

install: $(STAMP)

## The routing baselines (dynamo_cost, cache_aware, lmetric, llmd, llmd_sticky) are the kvsched-bench
## distribution (bench/pyproject.toml): the benches run them, and the tests check them.
TEST_STAMP := $(VENV)/.installed-test

$(TEST_STAMP): $(STAMP) bench/pyproject.toml
	$(BIN)/pip install --quiet --no-deps -e bench
	touch $(TEST_STAMP)

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(BIN)/python pyproject.toml bench/pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench,gateway]' -e bench
	$(BIN)/pip install --quiet -e '.[bench-dynamo]' || echo "ai-dynamo-runtime not installable here: the dynamo routing baseline will be skipped"
	touch $(BENCH_STAMP)

## Every benchmark (kernels, queue, the daemon vs echo vs Redis vs Dynamo, routing quality), plots and
## docs/BENCHMARKS.md tables from this machine (starts redis-server itself). About an hour on 2 cores:
## bench/bench_routing.py first runs 16 wall-clock replays (kv and dynamo 3 times each, dynamo_cost and
## cache_aware once, at 4 and 16 workers, ~2 min each), then ~340 virtual replays of ~20 s, 2 at a time.
bench: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py

## The same benches, shorter: out/bench/quick/ only, docs untouched (~5 min idle, ~12 on a loaded machine;
## routing on the 1,500-request slice with one seed: not comparable with the published grid).
bench-quick: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py --quick

## Replay the bundled Mooncake slice through a real daemon, simulated fleet and router processes.
demo: $(STAMP)
	$(BIN)/kvsched replay kvsched/data/mooncake_slice.jsonl --routers 4 --workers 4 --speedup 20 --out out/demo

## Daemon + 3 simulated HTTP engines + kvsched-gateway on http://127.0.0.1:8080 (curl it; Ctrl-C stops).
## Another port: make gateway-demo GATEWAY_DEMO_PORT=18080
GATEWAY_DEMO_PORT ?= 8080
gateway-demo: $(STAMP)
	$(BIN)/python -m kvsched.gateway.demo --port $(GATEWAY_DEMO_PORT)

## The full gate: lint, type check, then the test suite (unit, property and multi-process tests; with the
## kvsched-bench baselines).
test: lint typecheck $(TEST_STAMP)
	$(BIN)/python -m pytest -q

## ruff lint rules and formatting ([tool.ruff] in pyproject.toml); `ruff format .` fixes the second.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## mypy over the package ([tool.mypy] in pyproject.toml: strict on the wire contract, the router library and the core).
typecheck: $(STAMP)
	$(BIN)/mypy

## The in-process tests of core, shm, protocol and client (units and properties, the same hypothesis
## profile as `make test`; no daemon or other child process: tests marked `multiprocess` are left out).
## ~65 s of CPU with a warm numba cache (one process: about that wall on an idle machine). Not a gate: `make test` is.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not multiprocess" tests/core tests/shm tests/protocol tests/client

clean:
	rm -rf $(VENV) .numba-cache out .pytest_cache
