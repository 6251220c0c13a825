# Engram Service: set up, serve, test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint demo bench clean

install: $(STAMP)

# torch first, from the local CPU wheel: a plain "torch" requirement would pull GBs of CUDA packages.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The demo folder is an allowed model root unless you say otherwise.
run: install
	ENGRAM_MODEL_ROOTS="$${ENGRAM_MODEL_ROOTS:-$(CURDIR)/demo}" $(VENV)/bin/engram-service serve --host 127.0.0.1 --port 8000

demo: install
	$(PY) -m service.demo --out demo

test: install
	$(PY) -m pytest -q

# Performance goals of issue 4 (bench/README.md): prints a table, writes bench/results/latest.json.
# BENCH_ARGS=--quick for a smoke run on the tiny model only.
bench: install
	$(PY) -m bench.run $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check service workers api_schemas tests

clean:
	rm -rf $(VENV) .engram .pytest_cache
