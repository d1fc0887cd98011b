# Both targets create or refresh .venv themselves: a fresh clone needs nothing installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Each module is compiled by the first process that imports it and its .pyc kept: this host sets
# PYTHONDONTWRITEBYTECODE, and without .pyc files every process compiled torch again (make test
# took 8 minutes, not 5). Empty is unset, for Python.
export PYTHONDONTWRITEBYTECODE :=

# Offline-friendly defaults: the temporary Prefect server takes ~20 s to start on 2 cores.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export TOKENIZERS_PARALLELISM ?= false

# Extra pytest options, e.g. PYTEST_ARGS=--durations=20 (CI prints the slowest tests).
PYTEST_ARGS ?=

.PHONY: demo test unit matrix lint format clean screenshots vllm-env compiled

# Into venv $(1), packages $(2). torch first, pinned, with pip: resolving a bare torch pulls the
# newest CUDA build (several GB), and pip finds the CPU wheel these machines keep on disk. The
# rest with uv where it installs (about 150 packages in seconds, against 50 s for pip), else
# with pip. Not byte-compiled here: compiling every module took 30 of a first demo's 57 s of
# install, for the few it imports (below).
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --no-compile torch==2.13.0
	($(1)/bin/python -m pip install -q uv \
		&& $(1)/bin/python -m uv pip install -q --python $(1)/bin/python $(2)) \
		|| $(1)/bin/python -m pip install -q $(2)
endef

# The extras in a variable: a comma written inside $(call ...) would split its arguments.
EXTRAS := test,eval
$(STAMP): pyproject.toml
	$(call install,$(VENV),-e '.[$(EXTRAS)]')
	touch $(STAMP)

# vLLM in an environment of its own, as in production the serving image is not the compression
# image: it pins another compressed-tensors. Verify and evaluate-model find it here; without it
# they say the vLLM check was not run.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements-vllm.txt
	$(call install,$(VLLM_VENV),--no-deps -r requirements-vllm.txt)
	# Byte-compiled here, not by the first vLLM check: a fresh environment's first check spent
	# about 10 s of its 54 s compiling the modules it imports. Test folders left out; a module
	# that does not compile on this Python (torch's py312_intrinsics) is one vLLM never imports.
	$(VLLM_VENV)/bin/python -m compileall -q -j 0 -x '/(testing|tests)/' $$($(VLLM_VENV)/bin/python -c \
		"import importlib.util as u; print(*(u.find_spec(p).submodule_search_locations[0] \
		for p in ('vllm', 'torch', 'transformers')))") > /dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Byte-compiled once per install, for the tests: by importing what their processes import first,
# two processes at once (the stages' libraries; Prefect's server, worker and the flows), 25 s on a
# fresh clone. Each test process otherwise compiled them for itself as it started: a fresh make
# test took 377 s against 334 s with .pyc files present, and 353 s after this. Compiling every
# installed module instead (compileall, 44 s) left the tests no faster (350 s). The demo does not
# wait for it: its two processes compile what they import as they go.
COMPILED := $(VENV)/.compiled
# The stages' list is the forkserver's own (isolation.PRELOAD): what their children import.
STAGE_IMPORTS := import importlib; from compressflow.runtime.isolation import PRELOAD; \
	[importlib.import_module(name) for name in PRELOAD]
RUN_IMPORTS := compressflow.flows.cli, compressflow.flows.compress, compressflow.flows.evaluate, \
	compressflow.flows.sweep, prefect.server.api.server, prefect.workers.process, clearml, \
	lm_eval, hypothesis, xdist
$(COMPILED): $(STAMP)
	$(PY) -c "$(STAGE_IMPORTS)" & stages=$$!; \
		$(PY) -c "import $(RUN_IMPORTS)" && wait $$stages
	touch $(COMPILED)

compiled: $(COMPILED)

demo: $(STAMP)
	$(PY) -m compressflow.demo

# The folder decides a test's tier (tests/conftest.py sets the e2e and matrix markers from it).
# Every behaviour, one end-to-end run each: the unit and end-to-end tests; the slow matrices run
# in `make matrix`. Two test processes, a test file each at a time, as `make matrix`: an
# end-to-end test waits on servers, workers and stage children most of its time (one process:
# 378 s on a slow day here; two: 293 s).
test: $(COMPILED)
	$(PY) -m pytest -q -n 2 --dist loadfile tests/unit tests/e2e $(PYTEST_ARGS)

# The fast tests alone: no Prefect server, no end-to-end run. Two test processes (pytest-xdist):
# one waits on its stage children most of the time, leaving the other core idle (65 s -> 51 s
# here). Not more: each holds its own forkserver with the libraries (about 0.6 GB).
unit: $(COMPILED)
	$(PY) -m pytest -q -n 2 tests/unit $(PYTEST_ARGS)

# The slow set: the architecture and preset matrices (every family and CPU preset end to end)
# and the longest end-to-end drills (multi-process faults, torchrun launches); CI runs it after
# `make test`. Two test processes, a test file each at a time (a file's tests share what its
# first ones publish): much of a drill is waiting on servers, workers and imports. With waiting
# OpenMP threads asleep (tests/conftest.py), CI's run of the set went from 2164 s to 1504 s here.
# The yardstick trains once.
matrix: $(COMPILED)
	$(PY) -m pytest -q -n 2 --dist loadfile tests/matrix $(PYTEST_ARGS)

# Formatter, linter and the import-layers contract (pyproject.toml), as CI runs them.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) tools/check_layers.py
	$(PY) tools/check_references.py

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf .demo outputs

# The UI screenshots docs/deployments.md shows: a real server, the compress deployment on the tiny
# model, and Debian's headless chromium (apt-get install chromium).
screenshots: $(STAMP)
	$(PY) tools/ui_screenshots.py
