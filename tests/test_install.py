"""Installing: .ci/install-torch tries the PyTorch CPU index first and falls back at once when it does not
answer; the demo installs the package without the dev extra; pyproject.toml builds without a setuptools
deprecation warning. No network: the "indexes" are local sockets and pip is a stub that logs its arguments."""

import functools
import http.server
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings

import pytest
from repo_paths import REPO_ROOT

INSTALL_TORCH = os.path.join(REPO_ROOT, ".ci", "install-torch")

# A python that runs everything with the real interpreter except `-m pip`, which it logs (one line per run) and
# answers as pip would: a --report naming where the torch wheel came from; an exit 1 for a run with --index-url
# when PIP_FAILS_WITH_INDEX is set.
_STUB = """#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
    echo "${*:3}" >>"$PIP_LOG"
    index=""; report=""; prev=""
    for a in "$@"; do
        [ "$prev" = --index-url ] && index=$a
        [ "$prev" = --report ] && report=$a
        prev=$a
    done
    if [ -n "$index" ] && [ -n "${PIP_FAILS_WITH_INDEX:-}" ]; then exit 1; fi
    url="${index:-https://configured.example/simple}/torch-stub.whl"
    echo '{"install": [{"metadata": {"name": "torch"}, "download_info": {"url": "'"$url"'"}}]}' >"$report"
    exit 0
fi
exec %s "$@"
"""


@pytest.fixture
def stub_python(tmp_path):
    path = tmp_path / "python"
    path.write_text(_STUB % sys.executable)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _install(stub_python, tmp_path, index: str, *pip_options: str, **env) -> tuple[str, list[str], float]:
    """Runs .ci/install-torch with the stub: its stdout, the pip runs (their arguments) and its seconds."""
    log = tmp_path / "pip.log"
    start = time.monotonic()
    r = subprocess.run([INSTALL_TORCH, str(stub_python), "2.13.0", *pip_options], capture_output=True, text=True,
                       timeout=60,
                       env={**os.environ, "PIP_LOG": str(log), "TORCH_INDEX_URL": index, **env})
    assert r.returncode == 0, r.stderr
    runs = log.read_text().splitlines() if log.exists() else []
    return r.stdout, runs, time.monotonic() - start


@pytest.fixture
def torch_index(tmp_path):
    """A reachable "PyTorch index": an HTTP server with a torch/ page."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='torch-stub.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_index_costs_one_refused_request_and_no_pip_run(stub_python, tmp_path):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    out, runs, _ = _install(stub_python, tmp_path, index)
    assert len(runs) == 1 and "--index-url" not in runs[0] and runs[0].endswith("torch==2.13.0"), runs
    assert f"{index} is not reachable" in out
    assert "via pip's configured index: https://configured.example/simple/torch-stub.whl" in out


def test_an_index_that_never_answers_is_given_up_after_5_seconds(stub_python, tmp_path):
    with socket.socket() as silent:        # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        out, runs, seconds = _install(stub_python, tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")
    assert len(runs) == 1 and "--index-url" not in runs[0], runs
    assert "is not reachable" in out and seconds < 30


def test_a_reachable_index_is_used_with_a_short_timeout_and_no_retries(stub_python, tmp_path, torch_index):
    out, runs, _ = _install(stub_python, tmp_path, torch_index)
    assert len(runs) == 1, runs
    assert f"--timeout 5 --retries 0 --index-url {torch_index} " in runs[0]
    assert f"via pip --index-url {torch_index}: {torch_index}/torch-stub.whl" in out


def test_pip_failing_on_the_index_falls_back_to_the_configured_one(stub_python, tmp_path, torch_index):
    out, runs, _ = _install(stub_python, tmp_path, torch_index, PIP_FAILS_WITH_INDEX="1")
    assert len(runs) == 2 and "--index-url" in runs[0] and "--index-url" not in runs[1], runs
    assert f"pip could not install torch==2.13.0 from {torch_index}; using pip's configured index" in out
    assert "via pip's configured index" in out


def test_the_callers_pip_options_go_to_both_runs_and_the_short_timeout_wins(stub_python, tmp_path, torch_index):
    _, runs, _ = _install(stub_python, tmp_path, torch_index, "--no-cache-dir", "--retries", "10",
                          PIP_FAILS_WITH_INDEX="1")
    # pip keeps the last of a repeated option: the index's 5 s / no retries, the fallback's 10 retries
    assert runs[0].index("--retries 10") < runs[0].index("--retries 0") and "--no-cache-dir" in runs[0]
    assert "--retries 10" in runs[1] and "--retries 0" not in runs[1] and "--no-cache-dir" in runs[1]


def test_an_empty_index_setting_skips_it(stub_python, tmp_path):
    out, runs, _ = _install(stub_python, tmp_path, "")
    assert len(runs) == 1 and "--index-url" not in runs[0], runs
    assert "not reachable" not in out


def test_the_torch_line_says_which_build_it_is(stub_python, tmp_path):
    import torch

    out, _, _ = _install(stub_python, tmp_path, "")
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert f"install-torch: torch {torch.__version__} ({build}" in out


def _make_dry_run(target: str, venv) -> str:
    r = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_demo_installs_the_package_without_the_dev_extra_and_the_tests_with_it(tmp_path):
    demo = _make_dry_run("demo", tmp_path / "venv")
    assert f".ci/install-torch {tmp_path}/venv/bin/python 2.13.0" in demo
    assert "pip install -q -c " in demo and "-e '.[report]'\n" in demo and "[dev]" not in demo
    test = _make_dry_run("test", tmp_path / "venv")
    assert ".ci/install-torch" in test and "-e '.[dev]'" in test and "constraints.txt" in test


def test_pyproject_builds_without_a_setuptools_deprecation_warning():
    pytest.importorskip("setuptools", minversion="77")     # the first release that reads an SPDX `license`
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")       # setuptools' deprecations are warnings: fail on any
        dist = apply_configuration(Distribution(), os.path.join(REPO_ROOT, "pyproject.toml"))
    assert dist.metadata.license_expression == "Apache-2.0"
