"""The command line answers at once: ``--help``, ``--version`` and argument errors import none of the heavy
libraries (measured by the modules imported, not by the clock); every option says what it does; progress bars
know their total."""

import argparse
import os
import re
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT

from resumable_stream.app.cli import build_parser, main
from resumable_stream.testing import write_parquet_dataset

STREAM_YAML = os.path.join(REPO_ROOT, "examples", "tiny", "stream.yaml")

# what takes seconds to import (torch alone ~1.5 s on 2 cores); none is needed to parse a command line
HEAVY = {"torch", "datasets", "transformers", "accelerate", "pyarrow", "numpy", "pandas", "huggingface_hub",
         "safetensors", "matplotlib", "tqdm"}


def _imported_modules(args: list[str]) -> tuple[int, set[str], str]:
    """``python -X importtime -m resumable_stream ARGS`` in a fresh interpreter: its exit code, the top-level
    names of every module it imported (importtime lists each on stderr), and the rest of its stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "resumable_stream", *args], capture_output=True,
                       text=True, env=env, timeout=120)
    imported, other = set(), []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", line)
        if m:
            imported.add(m.group(1).split(".")[0])
        elif not line.startswith("import time:"):
            other.append(line)
    assert "resumable_stream" in imported, r.stderr[-2000:]    # the measure itself works
    return r.returncode, imported, "\n".join(other)


@pytest.mark.parametrize("args, code, says", [
    (["--help"], 0, ""),
    (["--version"], 0, ""),
    (["peek", "--help"], 0, ""),
    (["report", "--help"], 0, ""),     # (`train --help` too, but the lane guard takes it for a training)
    (["llamafactory", "--help"], 0, ""),
    (["peek"], 2, "the following arguments are required: CONFIG"),
    (["peek", "cfg.yaml", "--num", "-1"], 2, "--num: got -1; allowed: an integer >= 0"),
    (["no-such-command"], 2, "invalid choice: 'no-such-command'"),
    # a mistyped key: the config is checked before the readers are imported
    (["peek", STREAM_YAML, "data.bufer_size=3"], 2, "unknown key data.bufer_size; did you mean data.buffer_size?"),
    (["warmup", STREAM_YAML, "data.shuffle_seed=x"], 2, "data.shuffle_seed"),
    (["index", STREAM_YAML, "-o", "i.json", "data.split=3"], 2, "data.split"),
])
def test_help_version_and_argument_errors_import_no_heavy_library(args, code, says):
    returncode, imported, stderr = _imported_modules(args)
    assert returncode == code, stderr
    assert says in stderr
    assert not imported & HEAVY, f"`resumable-stream {' '.join(args)}` imports {sorted(imported & HEAVY)}"


def test_a_command_still_imports_what_it_needs():
    # the other side of the test above: laziness must not leave a command without its modules
    returncode, imported, stderr = _imported_modules(["inspect", "/no/such/state"])
    assert returncode == 2 and "stream state '/no/such/state': not found" in stderr
    assert {"pyarrow", "safetensors"} <= imported


def _parsers(parser: argparse.ArgumentParser, name: str = "resumable-stream"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _parsers(subparser, f"{name} {sub}")


def test_every_command_and_option_has_help():
    parser = build_parser()
    missing = []
    for name, p in _parsers(parser):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help and a.help != argparse.SUPPRESS}
                missing += [f"{name} {c} (the command)" for c in action.choices if c not in helped]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"without help text: {missing}"
    assert len(list(_parsers(parser))) == 8      # the walk sees every command (7) and the top level


def test_index_progress_bar_knows_the_number_of_files(tmp_path, capsys):
    write_parquet_dataset(str(tmp_path / "d"), rows=90, files=3, row_group_size=30)
    (tmp_path / "d.yaml").write_text(f"data:\n  dataset_name_or_path: parquet\n  data_files: {tmp_path}/d/*.parquet\n")
    assert main(["index", str(tmp_path / "d.yaml"), "-o", str(tmp_path / "i.json")]) == 0
    bar = capsys.readouterr().err.split("\r")[-1]      # the bar's last state
    assert re.search(r"indexing: 100%\|.*\| 3/3 \[", bar), bar
