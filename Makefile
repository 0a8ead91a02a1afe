# The two commands a newcomer needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench bench-peers clean

$(BIN)/timewheel: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/timewheel

demo: setup
	$(BIN)/timewheel demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m pytest bench --benchmark-only

bench-peers: setup
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m bench.peers run

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
