#!/usr/bin/env bash
# Builds the virtual environment benchmarks/peers.py runs in (default .venv-bench): the project with its dev
# extra, litdata 0.2.76 and mosaicml-streaming 0.13.0 (the `bench` extra), beside the CPU build of torch.
#
#   benchmarks/make_bench_venv.sh [VENV]        (or: make bench-peers-venv)
#
# * torch==2.13.0 is installed first (the CPU build: .ci/install-torch) and then pinned with a constraints file:
#   the peers' own torch requirements would otherwise let pip pick another (multi-GB CUDA) torch build.
# * mosaicml-streaming 0.13.0 requires transformers<5 (hence huggingface-hub<1), which no datasets 5.x allows,
#   and the dev extra's s3fs pins an fsspec that datasets 4.x refuses: `pip install .[dev,bench]` has no
#   solution. Its reader does not need transformers (only its text converters and its dataloader's type
#   checks import it, and they load with the transformers 5 installed here), so it is installed --no-deps
#   beside its other requirements, as its metadata lists them, numpy<2.2 included (the whole venv takes it).
# * Both peers require torchvision; no torchvision build on PyPI loads with torch 2.13.0, so it is removed.
#   litdata does not import it for what the benchmark reads; `import streaming` does (streaming.vision), so
#   benchmarks/_peers_compat.py stubs the two names it imports before importing streaming.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-bench}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
TORCH="torch==$TORCH_VERSION"

"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$ROOT/.ci/install-torch" "$PY" "$TORCH_VERSION"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf '%s\n' "$TORCH" "numpy<2.2.0" > "$CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" -e "$ROOT[dev]" "litdata==0.2.76"
# mosaicml-streaming 0.13.0's requirements less transformers and torchvision (see above)
"$PY" -m pip install -q -c "$CONSTRAINTS" --no-deps "mosaicml-streaming==0.13.0"
"$PY" -m pip install -q -c "$CONSTRAINTS" "boto3<2,>=1.21.45" "Brotli>=1.0.9" "google-cloud-storage<3.3.0,>=2.9.0" \
    "matplotlib<4,>=3.5.2" "numpy<2.2.0,>=1.21.5" "paramiko<4,>=2.11.0" "python-snappy<1,>=0.6.1" \
    "tqdm<5,>=4.64.0" "xxhash<4,>=3.0.0" "zstd<2,>=1.5.2.5" "oci<3,>=2.88" "azure-storage-blob<13,>=12.0.0" \
    "azure-storage-file-datalake<13,>=12.11.0" "azure-identity>=1.13.0" "catalogue<3,>=2"
"$PY" -m pip uninstall -q -y torchvision torchaudio 2>/dev/null || true
ROOT="$ROOT" "$PY" -c "
import sys; sys.path.insert(0, '$ROOT/benchmarks')
import _peers_compat; _peers_compat.stub_torchvision()
import datasets, litdata, streaming, torch, resumable_stream
print('bench venv ok:', 'torch', torch.__version__, '| litdata', litdata.__version__, '| mosaicml-streaming',
      streaming.__version__, '| datasets', datasets.__version__)"
