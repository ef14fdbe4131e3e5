# Both quick-start commands bootstrap their own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo stream-demo test test-fast test-floors bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build first: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

stream-demo: $(VENV)/.installed
	$(PY) examples/stream_demo.py

test: $(VENV)/.installed
	$(PY) -m ruff check resumable_stream tests examples benchmarks
	$(PY) -m pytest -q -p no:cacheprovider

# the fast lane: all but the slow tests (trainings in subprocesses, torchrun); see tests/lanes.py
test-fast: $(VENV)/.installed
	$(PY) -m ruff check resumable_stream tests examples benchmarks
	$(PY) -m pytest -q -p no:cacheprovider --fast

# a second venv (.venv-floors) with the declared lower bounds of datasets / transformers / accelerate / torch
test-floors:
	PYTHON=$(PYTHON) .ci/floors

bench: $(VENV)/.installed
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/resume_cost.py
	$(PY) benchmarks/resume.py

clean:
	rm -rf $(VENV) .venv-floors .bench .pytest_cache
