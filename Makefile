# Both quick-start commands bootstrap their own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo stream-demo test test-fast test-floors test-llamafactory test-mindspore test-veomni bench bench-peers clean

TORCH ?= 2.13.0

# The package and the CPU build of torch, first (.ci/install-torch: the PyTorch CPU index if it answers, else
# pip's configured index; an unpinned torch from PyPI is the multi-GB CUDA build): all the demos need, with
# the report extra (matplotlib) for the `resumable-stream report` commands the demo ends with.
$(VENV)/.base: pyproject.toml .ci/install-torch
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	.ci/install-torch $(PY) $(TORCH)
	echo "torch==$(TORCH)" > $(VENV)/constraints.txt    # nothing installed later may move torch
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[report]'
	touch $@

# + the dev extra (pytest, ruff, hypothesis, moto, s3fs, torchdata, ...): the tests and benchmarks
$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	touch $@

# OUT=dir keeps the demo's runs there (default: a temporary directory, removed)
demo: $(VENV)/.base
	$(PY) examples/demo.py $(if $(OUT),--out $(OUT))

stream-demo: $(VENV)/.base
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

# a fifth venv (.venv-veomni) with veomni==0.1.12 (torch 2.13.0 CPU, transformers 5.9.0): tests/against_veomni
test-veomni:
	PYTHON=$(PYTHON) .ci/veomni

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
	rm -rf $(VENV) .venv-floors .venv-llamafactory .venv-mindspore .venv-veomni .venv-bench .bench .pytest_cache
