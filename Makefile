# Both quick-start commands bootstrap their own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo stream-demo test test-fast test-floors test-llamafactory test-mindspore bench bench-peers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build first: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# OUT=dir keeps the demo's runs there (default: a temporary directory, removed)
demo: $(VENV)/.installed
	$(PY) examples/demo.py $(if $(OUT),--out $(OUT))

stream-demo: $(VENV)/.installed
	$(PY) examples/stream_demo.py

test: $(VENV)/.installed
	$(PY) -m ruff check resumable_stream tests examples benchmarks
	$(PY) -m pytest -q -p no:cacheprovider

# the fast lane: all but the slow tests (trainings in subprocesses, torchrun); see tests/_support/lanes.py
test-fast: $(VENV)/.installed
	$(PY) -m ruff check resumable_stream tests examples benchmarks
	$(PY) -m pytest -q -p no:cacheprovider --fast

# a second venv (.venv-floors) with the declared lower bounds of datasets / transformers / accelerate / torch
test-floors:
	PYTHON=$(PYTHON) .ci/floors

# a third venv (.venv-llamafactory) beside llamafactory==0.9.5 and its pins (datasets 4.0.0, s3fs 2025.3.0, ...)
test-llamafactory:
	PYTHON=$(PYTHON) .ci/llamafactory

# a fourth venv (.venv-mindspore) with mindspore==2.10.0 and no torch: tests/against_mindspore (its PyTorch side
# runs in .venv)
test-mindspore: $(VENV)/.installed
	PYTHON=$(PYTHON) RS_TORCH_PYTHON=$(abspath $(PY)) .ci/mindspore

bench: $(VENV)/.installed
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/resume_cost.py
	$(PY) benchmarks/resume.py

# ours against litdata, MosaicML Streaming and HF streaming, in a venv of its own (.venv-bench: the bench extra;
# benchmarks/make_bench_venv.sh says why it is not .venv)
.venv-bench/.installed: pyproject.toml benchmarks/make_bench_venv.sh
	PYTHON=$(PYTHON) benchmarks/make_bench_venv.sh .venv-bench
	touch $@

bench-peers: .venv-bench/.installed
	.venv-bench/bin/python benchmarks/peers.py

clean:
	rm -rf $(VENV) .venv-floors .venv-llamafactory .venv-mindspore .venv-bench .bench .pytest_cache
