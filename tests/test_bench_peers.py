"""benchmarks/peers.py keeps running as the library changes: ours alone (the peers are not in this venv),
a small run whose correctness figures are checked (exact resume, each row once on 4 uneven ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
def test_peers_benchmark_quick_run_of_ours(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"), "--quick", "--readers", "ours",
         "--only", "read,resume,ranks", "--data-dir", str(tmp_path / "data"), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    read = res["read"]["ours"]["runs"][0]
    assert (read["rows_once"], read["rows_more"], read["rows_never"]) == (100_000, 0, 0)
    assert read["peak_above_imports_mib"] > 0 and res["read"]["pyarrow"]["rows_cpu_s"] > 0
    assert res["resume"]["ours"]["exact"] == res["resume"]["ours"]["check"] == 1000
    assert res["ranks"]["ours"]["exactly_once"] and sum(res["ranks"]["ours"]["per_rank"]) == 10_003
    assert "| resume: load -> first sample |" in proc.stdout
