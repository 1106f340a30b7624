# Set-up and everyday commands. Everything installs into .venv from pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
# Bytecode for our own modules, written once: the suite starts the broker and the CLI as new
# processes some thousands of times, and where PYTHONDONTWRITEBYTECODE is set (or the tree is
# fresh) each one compiled every module from source again: 0.5 s of CPU per broker start
# instead of 0.2 s. compileall is incremental, and __pycache__ is ignored by git.
BYTECODE := $(BIN)/python -m compileall -q -j 0 blipmq_server blipmq_cli spark_tools \
	pyspark_blipmq_wal bench tests > /dev/null

.PHONY: run test test-fast lint bench bench-durability bench-compare clean dist dist-arm64

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e . --config-settings editable_mode=compat
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,spark]' --config-settings editable_mode=compat
	touch $(VENV)/.installed $@

## run: start the broker on 127.0.0.1:7878 (MQTT on 127.0.0.1:1883) with config/blipmq.toml and ./data
run: $(VENV)/.installed
	$(BIN)/blipmq start --config config/blipmq.toml --data-dir ./data

# The tests mostly wait (broker subprocesses, the CLI through pipes, mosquitto, Spark), so
# pytest-xdist runs them on WORKERS processes; tests marked xdist_group share one worker.
# WORKERS=0 runs them in this process, one after another.
WORKERS ?= 2
PYTEST_PARALLEL := -n $(WORKERS) --dist loadgroup

## test: install everything and run the whole suite (lint, unit, server, end-to-end, slow)
test: $(STAMP)
	$(BIN)/ruff check .
	scripts/test-deps
	$(BYTECODE)
	$(BIN)/pytest -q $(PYTEST_PARALLEL) --durations=25

## test-fast: the suite without the tests marked slow
test-fast: $(STAMP)
	$(BYTECODE)
	$(BIN)/pytest -q $(PYTEST_PARALLEL) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## bench: one broker with its own clients: throughput, fan-out, latency, CLI pipe (prints figures)
bench: $(STAMP)
	$(BIN)/python bench/run.py

## bench-durability: fsync rate, QoS 1 group commit, log on/off, restart, backlog RSS
bench-durability: $(STAMP)
	$(BIN)/python bench/durability.py
	$(BIN)/python bench/backlog.py

## bench-compare: BlipMQ vs mosquitto, nats-server, redis-server (docs/bench/, charts)
bench-compare: $(STAMP)
	$(BIN)/python bench/compare.py

## dist: the executable for this machine in dist/ (onefile, onedir .tar.gz); see packaging/
dist:
	$(PY) packaging/build.py

## dist-arm64: the aarch64 executable, built in an emulated Debian 12 root, smoke-tested under qemu (root, ~20 min)
dist-arm64: $(STAMP)
	packaging/arm64.sh all

clean:
	rm -rf $(VENV) data .pytest_cache
