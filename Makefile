# The two commands a newcomer needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test fuzz bench bench-peers clean

$(BIN)/timewheel: pyproject.toml setup.py storage/_record_scan.pyx storage/_record_header.pyx storage/_record_header.pxd forwarder/_ingest_walk.pyx forwarder/_record_cut.pyx forwarder/rocketmq/_uniq_key.pyx
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/timewheel

demo: setup
	$(BIN)/timewheel demo

test: setup
	$(BIN)/python -m pytest

# the ingest pipeline under many more arbitrary messages than `make test` runs (FUZZ_EXAMPLES=N for more)
FUZZ_EXAMPLES ?= 20000
fuzz: setup
	TIMEWHEEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/fuzz -q --hypothesis-show-statistics

bench: setup
	$(BIN)/python -m pytest bench --benchmark-only

bench-peers: setup
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m bench.peers run

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
