"""The command line: peek, inspect, errors as one readable line, and the quick-start demo."""

import json
import os
import subprocess
import sys

import pytest
from helpers import take_ids
from repo_paths import REPO_ROOT

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.app.cli import main

ROOT = REPO_ROOT


def _yaml(tmp_path, directory, extra=""):
    p = tmp_path / "cfg.yaml"
    p.write_text(f"data:\n  dataset_name_or_path: parquet\n  data_files: {directory}/*.parquet\n"
                 f"  shuffle: true\n  buffer_size: 64\n{extra}")
    return str(p)


def test_peek_prints_the_samples_the_stream_yields(parquet_small, tmp_path, capsys):
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--rank", "1", "--world-size", "2", "--num", "25"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    expected = take_ids(ResumableStream(StreamConfig.from_yaml(cfg_path), rank=1, world_size=2), 25)
    assert [x["id"] for x in lines] == expected
    assert set(lines[0]) == {"id", "text", "label"}


def test_peek_fields_and_save_state_then_resume(parquet_small, tmp_path, capsys):
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--num", "30", "--fields", "id,label", "--save-state", str(tmp_path / "st")]) == 0
    first = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert set(first[0]) == {"id", "label"}
    assert os.path.isfile(tmp_path / "st" / "rank-00000.safetensors")
    assert main(["peek", cfg_path, "--num", "10", "--fields", "id", "--resume-from", str(tmp_path / "st")]) == 0
    second = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
    assert [x["id"] for x in first] + second == take_ids(
        ResumableStream(StreamConfig.from_yaml(cfg_path), rank=0, world_size=1), 40)


def test_peek_one_rank_of_several_refuses_to_save_over_a_complete_state(parquet_small, tmp_path, capsys):
    """A rank's new file next to a complete multi-rank state would leave the old manifest in charge (a later
    --resume-from would silently take the old state): refused, and the state stays what it was."""
    from resumable_stream.state import checkpoint as ckpt

    cfg_path = _yaml(tmp_path, parquet_small)
    st = str(tmp_path / "st")
    for rank in range(2):
        assert main(["peek", cfg_path, "--rank", str(rank), "--world-size", "2", "--num", "2",
                     "--save-state", st]) == 0
    ckpt.write_manifest(st, 2)
    before = sorted(os.listdir(st))
    capsys.readouterr()
    assert main(["peek", cfg_path, "--rank", "1", "--world-size", "2", "--num", "6", "--save-state", st]) == 2
    assert "--save-state" in capsys.readouterr().err and sorted(os.listdir(st)) == before
    assert main(["peek", cfg_path, "--rank", "1", "--world-size", "2", "--num", "2", "--fields", "id",
                 "--resume-from", st]) == 0
    resumed = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
    assert resumed == take_ids(ResumableStream(StreamConfig.from_yaml(cfg_path), rank=1, world_size=2), 4)[2:]


def test_peek_takes_the_world_size_and_workers_of_the_state_it_resumes(parquet_small, tmp_path, capsys):
    """It defaulted to one rank and failed on a 2-rank checkpoint unless told --world-size 2."""
    from resumable_stream.state import checkpoint as ckpt

    cfg_path = _yaml(tmp_path, parquet_small)
    st = str(tmp_path / "st")
    for rank in range(2):
        assert main(["peek", cfg_path, "--rank", str(rank), "--world-size", "2", "--num-workers", "1", "--num", "3",
                     "--save-state", st]) == 0
    ckpt.write_manifest(st, 2)
    for argv in (["--rank", "1"], ["--rank", "1", "--world-size", "2", "--num-workers", "1"]):
        capsys.readouterr()
        assert main(["peek", cfg_path, *argv, "--num", "2", "--fields", "id", "--resume-from", st]) == 0
        resumed = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
        assert resumed == take_ids(ResumableStream(StreamConfig.from_yaml(cfg_path), rank=1, world_size=2,
                                                   num_workers=1), 5)[3:]
    capsys.readouterr()      # data.resume_state_path in the yaml: the same
    assert main(["peek", cfg_path, f"data.resume_state_path={st}", "--num", "2", "--fields", "id"]) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == take_ids(
        ResumableStream(StreamConfig.from_yaml(cfg_path), rank=0, world_size=2, num_workers=1), 5)[3:]


def test_warmup_and_peek_name_the_state_to_start_from_alike():
    from resumable_stream.app.cli import build_parser

    parser = build_parser()
    for command in ("peek", "warmup"):
        sub = parser._subparsers._group_actions[0].choices[command]
        options = {o for a in sub._actions for o in a.option_strings}
        assert "--resume-from" in options and "--from" not in options, command


def test_inspect_file_and_directory(parquet_small, tmp_path, capsys):
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--num", "70", "--save-state", str(tmp_path / "ck" / "stream_state")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = json.loads(capsys.readouterr().out)
    part = out["ranks"]["rank-00000.safetensors"]["partitions"]["0"]
    assert part["consumed_samples"] == 70 and part["window"] == 1 and part["offset_in_window"] == 6
    assert out["world_size"] == 1
    assert main(["inspect", str(tmp_path / "ck" / "stream_state" / "rank-00000.safetensors"), "--full"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["files"]["count"] == 4 and len(one["files"]["files"]) == 4 and one["order"]["buffer_size"] == 64


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["peek", "{cfg}", "--fields", "nope"], "--fields: unknown column(s) nope"),
        (["peek", "{cfg}", "--rank", "2", "--world-size", "2"], "--rank: got 2"),
        (["peek", "{tmp}/missing.yaml"], "not found"),
        (["peek", "{cfg}", "--resume-from", "{tmp}/none"], "not found"),
        (["inspect", "{tmp}/none"], "not found"),
        (["inspect", "{tmp}/bad.safetensors"], "corrupt or truncated"),
    ],
)
@pytest.mark.slow
def test_errors_are_one_line_without_traceback(parquet_small, tmp_path, argv, needle):
    cfg_path = _yaml(tmp_path, parquet_small)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    argv = [a.format(cfg=cfg_path, tmp=tmp_path) for a in argv]
    r = subprocess.run([sys.executable, "-m", "resumable_stream.app.cli", *argv], capture_output=True, text=True)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_debug_shows_the_traceback(parquet_small, tmp_path):
    argv = ["--debug", "peek", _yaml(tmp_path, parquet_small), "--fields", "nope"]
    r = subprocess.run([sys.executable, "-m", "resumable_stream.app.cli", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" in r.stderr and "ConfigError" in r.stderr


@pytest.mark.slow
def test_mismatch_lists_every_difference_on_its_own_line(parquet_small, tmp_path):
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--num", "5", "--save-state", str(tmp_path / "s.safetensors")]) == 0
    other = _yaml(tmp_path, parquet_small, extra="  shuffle_seed: 5\n")
    r = subprocess.run([sys.executable, "-m", "resumable_stream.app.cli", "peek", other, "--resume-from",
                        str(tmp_path / "s.safetensors")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "data.shuffle_seed: saved 42, now 5" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "resumable-stream")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "peek" in r.stdout and "inspect" in r.stdout


@pytest.mark.slow
def test_quick_start_demo_kills_and_resumes_exactly(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "stream_demo.py"), "--steps", "160",
                        "--save-every", "30", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed with SIGKILL" in r.stdout and "RESULT: exact resume" in r.stdout
    assert r.stdout.count("identical to the uninterrupted run") == 2


@pytest.mark.slow
def test_quick_start_training_demo_resumes_exactly(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--steps", "40",
                        "--save-steps", "15", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed with SIGKILL" in r.stdout and "resumed from checkpoint-" in r.stdout
    assert "RESULT: the resumed run consumed exactly what an uninterrupted one would" in r.stdout
    _check_ids_around_resume(r.stdout, tmp_path)
    _check_printed_commands(r.stdout, tmp_path)


def _check_printed_commands(stdout, work):
    """The demo ends with the inspect / report commands for the runs it kept (--out): each one runs, on
    those runs."""
    import shlex

    commands = [shlex.split(line.split("#")[0]) for line in stdout.split("look into them with:", 1)[1].splitlines()
                if " inspect " in line or " report " in line]
    kinds = sorted(c[1] if c[0].endswith("resumable-stream") else c[3] for c in commands)
    assert kinds == ["inspect", "report", "report"], stdout
    # the three commands read the runs and write apart (report.png in each run): they run side by side
    started = [(command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
               for command in commands]
    for command, proc in started:
        out, err = proc.communicate(timeout=300)
        r = subprocess.CompletedProcess(command, proc.returncode, out, err)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
        if "inspect" in command:   # the newest complete checkpoint of the resumed run: its last one
            state = json.loads(r.stdout)
            assert state["checkpoint"] == str(work / "killed-and-resumed" / "checkpoint-40"), state["checkpoint"]
            assert state["world_size"] == 1 and state["progress"], state
    for run in ("killed-and-resumed", "uninterrupted"):
        assert (work / run / "report.png").stat().st_size > 0, f"report did not draw {run}"


def _consumed_log(path):
    with open(path, encoding="utf-8") as f:
        return {rec["step"]: rec["samples"] for rec in map(json.loads, f)}


def _check_ids_around_resume(stdout, work):
    """The demo's table of sample keys around the resume point shows what the logs say: the killed run's
    (saved before the restart cut its log back), the resumed run's after the checkpoint, the reference's."""
    import re

    resumed_at = int(re.search(r"resumed from checkpoint-(\d+)", stdout).group(1))
    logs = {"killed": _consumed_log(work / "killed-consumed.jsonl"),
            "resumed": _consumed_log(work / "killed-and-resumed" / "consumed" / "rank-00000.jsonl"),
            "reference": _consumed_log(work / "uninterrupted" / "consumed" / "rank-00000.jsonl")}
    killed_at = max(logs["killed"])

    def shown(ids):
        return "-" if ids is None else " ".join(ids[:3]) + (f" +{len(ids) - 3}" if len(ids) > 3 else "")

    rows = [m.groups() for m in re.finditer(r"^ +(\d+) \| (.*?) +\| (.*?) +\| (.*?)(?: +<- (.*))?$", stdout, re.M)]
    steps = [int(step) for step, *_ in rows]
    assert {resumed_at, resumed_at + 1, killed_at} <= set(steps), (steps, resumed_at, killed_at, stdout)
    for step, killed, resumed, reference, note in rows:
        step = int(step)
        assert killed == shown(logs["killed"].get(step)), (step, stdout)
        assert resumed == shown(logs["resumed"][step] if step > resumed_at else None), (step, stdout)
        assert reference == shown(logs["reference"][step]) != "-", (step, stdout)
        if step > resumed_at:
            assert resumed == reference, (step, stdout)
        assert (note is not None) == (step in (resumed_at, killed_at)), (step, stdout)


@pytest.mark.slow
def test_version_and_python_m_run_the_command_line(tmp_path):
    """``resumable-stream --version`` prints the package version (the one pyproject.toml declares), and
    ``python -m resumable_stream`` is the same command line (here: an error on a missing config, exit 2)."""
    import re

    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "resumable_stream", "--version"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, f"resumable-stream {declared}"), r.stderr
    missing = str(tmp_path / "nope.yaml")
    r = subprocess.run([sys.executable, "-m", "resumable_stream", "peek", missing], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and f"config file {missing!r}: not found" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_peek_resume_from_exits_cleanly_200_times(parquet_small, tmp_path):
    """`peek --resume-from` stops its readers before interpreter teardown: 200 runs (forked after the
    imports by tests/_support/peek_runs.py, 2 at a time; after run 0, with the modules it imported) all exit 0 with
    the right samples; none aborts at exit."""
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--num", "30", "--save-state", str(tmp_path / "st")]) == 0
    expected = take_ids(ResumableStream(StreamConfig.from_yaml(cfg_path), rank=0, world_size=1), 35)[30:]
    out = tmp_path / "runs"
    out.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_support", "peek_runs.py"),
                        "--import-what-run-0-imports", "200", "2", str(out),
                        "peek", cfg_path, "--num", "5", "--fields", "id", "--resume-from", str(tmp_path / "st")],
                       capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stderr
    codes = json.loads(r.stdout)["exit_codes"]
    failed = {i: (c, (out / f"{i}.err").read_text()[-300:]) for i, c in enumerate(codes) if c != 0}
    assert len(codes) == 200 and not failed, failed
    for i in range(200):
        assert [json.loads(x)["id"] for x in (out / f"{i}.out").read_text().splitlines()] == expected


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_remote_peek_with_prefetch_in_flight_exits_cleanly_40_times(tmp_path, hub_offline):
    """`peek` over HTTP (12 files, 30 ms per request) stops after 5 samples while the prefetch is still
    fetching and decoding row groups ahead: 40 runs (forked after the imports by tests/_support/peek_runs.py) all exit 0
    with the right samples, none aborts at interpreter teardown (`terminate called ...`); so do 20 runs of
    plain Python that read 5 samples and leave the stream unclosed."""
    import yaml
    from http_server import FileServer

    from resumable_stream.testing import write_parquet_dataset

    www = tmp_path / "www"
    write_parquet_dataset(str(www), rows=12 * 4000, files=12, row_group_size=1000, words=20)
    with FileServer(www) as srv:
        srv.latency_s = 0.03
        cfg_path = tmp_path / "remote.yaml"
        cfg_path.write_text(yaml.safe_dump({"data": {
            "dataset_name_or_path": "parquet", "data_files": [srv.url(n) for n in sorted(os.listdir(www))],
            "shuffle": True, "buffer_size": 256, "prefetch_blocks": 8}}))
        expected = take_ids(ResumableStream(StreamConfig.from_yaml(str(cfg_path))), 5)
        for how, n, argv in (("peek", 40, ["peek", str(cfg_path), "--num", "5", "--fields", "id"]),
                             ("plain", 20, ["plain", str(cfg_path), "5"])):   # a stream left unclosed
            out = tmp_path / how
            out.mkdir()
            before = len(srv.requests)
            r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_support", "peek_runs.py"), str(n), "2", str(out),
                                *argv], capture_output=True, text=True, timeout=800)
            assert r.returncode == 0, r.stderr
            codes = json.loads(r.stdout)["exit_codes"]
            errors = {i: (out / f"{i}.err").read_text() for i in range(n)}
            failed = {i: (c, errors[i][-300:]) for i, c in enumerate(codes) if c != 0 or "terminate" in errors[i]}
            assert len(codes) == n and not failed, (how, failed)
            for i in range(n):
                assert [json.loads(x)["id"] for x in (out / f"{i}.out").read_text().splitlines()] == expected
            ranged = [rec for rec in srv.requests[before:] if rec.method == "GET" and rec.range]
            assert len(ranged) > n * 3             # each run had fetches ahead going when it stopped


def test_inspect_a_run_dir_reads_its_newest_complete_checkpoint(parquet_small, tmp_path, capsys):
    """An output_dir with checkpoint-N/ dirs: the newest complete one is shown and named; a newer one cut
    short (no manifest) and an older one are not."""
    cfg_path = _yaml(tmp_path, parquet_small)
    run = tmp_path / "run"
    for step, n in ((10, 20), (20, 40), (30, 60)):
        assert main(["peek", cfg_path, "--num", str(n), "--save-state",
                     str(run / f"checkpoint-{step}" / "stream_state")]) == 0
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    os.remove(run / "checkpoint-30" / "stream_state" / "manifest.json")      # cut short by a kill
    capsys.readouterr()
    assert main(["inspect", str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_dir"] == str(run) and out["checkpoint"] == str(run / "checkpoint-20")
    assert out["ranks"]["rank-00000.safetensors"]["partitions"]["0"]["consumed_samples"] == 40
    for step in (10, 20):
        os.remove(run / f"checkpoint-{step}" / "trainer_state.json")
    assert main(["inspect", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"run directory {str(run)!r}: none of its checkpoints" in err and "checkpoint-30" in err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["peek", "inspect"])
def test_a_closed_pipe_is_a_clean_exit(parquet_small, tmp_path, command):
    """`... | head -1`: the reader goes away; the command exits 0 without a BrokenPipeError on stderr (also
    not the interpreter's "Exception ignored" at its flush on exit)."""
    cfg_path = _yaml(tmp_path, parquet_small)
    assert main(["peek", cfg_path, "--num", "5", "--save-state", str(tmp_path / "ck" / "stream_state")]) == 0
    argv = {"peek": ["peek", cfg_path, "--num", "5000"], "inspect": ["inspect", str(tmp_path / "ck"), "--full"]}
    for read_first in (True, False):      # like head -1, and a reader gone before anything was written
        p = subprocess.Popen([sys.executable, "-m", "resumable_stream", *argv[command]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=ROOT)
        if read_first:
            assert p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0, err
        assert "BrokenPipe" not in err and "Exception ignored" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("builder, ext", [("csv", "csv"), ("text", "txt")])     # JSON lines are indexed (jsonl)
def test_index_of_data_without_an_index_says_so_at_once_for_a_user(tmp_path, capsys, builder, ext):
    """It pointed the user at an internal source file (resumable_stream/config/formats.py), after a progress bar."""
    (tmp_path / f"x.{ext}").write_text("a\n1\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"dataset_name_or_path: {builder}\ndata_files: {tmp_path / f'x.{ext}'}\n")
    capsys.readouterr()
    assert main(["index", str(config), "-o", str(tmp_path / "i.json")]) == 2
    err = capsys.readouterr().err
    assert f"data.dataset_name_or_path '{builder}' is read by datasets' '{builder}' builder, which has no dataset " \
           "index; allowed: data of an indexed format (jsonl, parquet, webdataset; docs/formats.md)" in err, err
    assert ".py" not in err and "indexing" not in err and not (tmp_path / "i.json").exists()
