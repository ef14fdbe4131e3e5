"""Hostile inputs on the newest surfaces (issue 49): each is refused at once with our own error naming the key or
file (exit 2 at the CLI), or handled right; none overflows, hangs or grows memory.

1. mixture weights near the float maximum (their sum overflows to inf);
2. numbers a float cannot hold (a 400-digit integer) where a number is expected; val_size .inf / .nan;
3. yaml: alias chains ("billion laughs"), an alias inside the node it names, nesting, files over the bound,
   integers of thousands of digits; the same errors from the C and the pure-Python loader;
4. images: a NUL byte in a path or a control character in a URL, more pixels than allowed (refused from the
   header, before decoding);
5. set_weights from a thread other than the one iterating;
6. a checkpoint whose manifest.json is a symlink or not a regular file.

Tar members that lie about their size are tests/sources/test_tar_hostile.py's; a damaged checkpoint's
tests/state/test_sidecar_integrity.py's and test_sidecar_bounds.py's.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from repo_paths import REPO_ROOT

from resumable_stream import MixtureStream, StreamConfig
from resumable_stream.app.cli import main
from resumable_stream.config.trainer import data_config_from_yaml
from resumable_stream.errors import ConfigError
from resumable_stream.integrations.llamafactory.held_out import check_val_size
from resumable_stream.integrations.llamafactory.media import checked_images
from resumable_stream.io.net import RetryPolicy
from resumable_stream.loader import StreamLoader
from resumable_stream.state import names, output_dir
from resumable_stream.stream.weights import DatasetsDraws
from resumable_stream.testing import synthetic_rows
from resumable_stream.transforms import TransformConfig
from resumable_stream.transforms.vl import BadSample, decode_image

HUGE = 10 ** 400            # math.isfinite(HUGE) raises OverflowError; float(HUGE) too
LOADERS = [yaml.SafeLoader] + ([yaml.CSafeLoader] if yaml.__with_libyaml__ else [])


def yaml_files():
    """The module (new with issue 49; imported here so that this file's other tests run against code without it)."""
    from resumable_stream.config import yaml_files

    return yaml_files


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    for name, start in (("a", 0), ("b", 100_000)):
        os.makedirs(root / name)
        pq.write_table(pa.table(synthetic_rows(start, 400)), root / name / "part.parquet", row_group_size=100)
    return root


def _write(path, doc) -> str:
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def _peek(capsys, config: str, *overrides: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["peek", config, "--num", "1", *overrides])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------ 1. weights that overflow their sum
def _mixture(data, weights) -> dict:
    return {"sources": [{"label": label, "dataset_name_or_path": "parquet", "weight": w,
                         "data_files": str(data / label / "*.parquet")} for label, w in zip("ab", weights)],
            "shuffle": True, "buffer_size": 64}


@pytest.mark.parametrize("weights", [(1e308, 1e308), (1.7e308, 1.7e308),
                                     ({"schedule": "linear", "points": [[0, 1e308], [10, 1e308]], "unit": "samples"},
                                      {"schedule": "constant", "points": [[0, 1e308]], "unit": "samples"})])
def test_weights_near_the_float_maximum_draw_as_their_ratio(data, weights):
    """A 50/50 mixture written with weights whose sum overflows to inf: every probability was 0 and all 400
    draws went to the last source."""
    cfg = StreamConfig.from_dict(_mixture(data, weights))
    assert cfg.probabilities == (0.5, 0.5)
    stream = MixtureStream(cfg, rank=0, world_size=1)
    picks = collections.Counter(row["id"] // 100_000 for _, row in zip(range(400), stream))
    assert 150 <= picks[0] <= 250 and picks[0] + picks[1] == 400, picks     # 400 fair draws: 200 +- 2.5 sigma
    assert stream.current_weights() == {"a": 0.5, "b": 0.5}


def test_weights_near_the_float_maximum_in_set_weights_and_in_datasets_draws(data):
    stream = MixtureStream(StreamConfig.from_dict(_mixture(data, (1, 3))), rank=0, world_size=1)
    stream.set_weights({"a": 1.5e308, "b": 1.5e308})
    assert stream.current_weights() == {"a": 0.5, "b": 0.5}
    picks = collections.Counter(row["id"] // 100_000 for _, row in zip(range(400), stream))
    assert 150 <= picks[0] <= 250, picks
    assert DatasetsDraws("datasets_choice", (1e308, 1e308), seed=0).p.tolist() == [0.5, 0.5]


# ------------------------------------------------------------------------------ 2. numbers a float cannot hold
NUMBER_KEYS = ["timeout_s", "retry_backoff_s", "retry_budget_s", "cache_size_limit_gb", "prefetch_memory_mb",
               "poll_interval_s", "follow_timeout_s"]


@pytest.mark.parametrize("key", NUMBER_KEYS)
def test_an_integer_of_400_digits_is_a_config_error_naming_the_key(tmp_path, capsys, data, key):
    doc = {"dataset_name_or_path": "parquet", "data_files": str(data / "a" / "*.parquet"), key: HUGE}
    with pytest.raises(ConfigError, match=rf"^data\.{key}: got <an integer of 401 digits>; allowed: "):
        StreamConfig.from_dict(doc)
    code, err = _peek(capsys, _write(tmp_path / "c.yaml", doc))
    assert code == 2 and f"data.{key}: got <an integer of 401 digits>; allowed" in err and "unexpected" not in err


def test_cache_size_limit_that_overflows_the_byte_count_is_refused():
    with pytest.raises(ConfigError, match=r"data\.cache_size_limit_gb: got 1e\+300; allowed: .* at most 1e9"):
        StreamConfig(dataset_name_or_path="org/x", cache_size_limit_gb=1e300)


@pytest.mark.parametrize("weight, key", [
    (HUGE, r"data\.sources\[0\]\.weight: got <an integer of 401 digits>"),
    ({"points": [[0, HUGE]]}, r"data\.sources\[0\]\.weight\.points\[0\]: got \[0, <an integer of 401 digits>\]"),
    ({"points": [[HUGE, 1]]}, r"data\.sources\[0\]\.weight\.points\[0\]: got \[<an integer of 401 digits>, 1\]"),
])
def test_a_weight_or_schedule_point_of_400_digits_is_a_config_error(data, weight, key):
    with pytest.raises(ConfigError, match=key):
        StreamConfig.from_dict(_mixture(data, (weight, 1)))


def test_set_weights_of_400_digits_is_a_config_error(data):
    stream = MixtureStream(StreamConfig.from_dict(_mixture(data, (1, 1))), rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"set_weights: weights\['a'\]: got <an integer of 401 digits>"):
        stream.set_weights({"a": HUGE, "b": 1})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), HUGE, 2.0 ** 64])
def test_val_size_that_is_no_row_count_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"^val_size: got .*allowed: an integer >= 1"):
        check_val_size({"val_size": value})


# ------------------------------------------------------------------------------ 3. yaml built to blow up
def laughs(levels: int = 9, under: str = "buffer_size") -> str:
    lines = ["dataset_name_or_path: parquet", "data_files: x.parquet",
             "l0: &l0 [" + ", ".join(['"lol"'] * 9) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines + [f"{under}: *l{levels - 1}"]) + "\n"


def _in_a_bounded_process(script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``script`` in a child limited to 2 GiB of address space and ``timeout`` seconds (a regression must not take
    the machine's memory with it)."""
    bounded = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n" + script)
    return subprocess.run([sys.executable, "-c", bounded], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)


@pytest.mark.parametrize("under", ["buffer_size", "data_files"])
def test_billion_laughs_is_refused_at_once_with_a_short_message(tmp_path, under):
    """1 KB of yaml that expands to 10**9 items: the value was expanded while its error message was built (past
    1.5 GB in 30 s); now the aliases are counted before any value is built."""
    path = _write(tmp_path / "laughs.yaml", laughs(under=under))
    assert os.path.getsize(path) < 1024
    started = time.perf_counter()
    run = _in_a_bounded_process(
        "import sys\nfrom resumable_stream.app.cli import main\n"
        f"sys.exit(main(['peek', {path!r}, '--num', '1']))")
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"config file {path!r}: its aliases expand" in run.stderr and "allowed: aliases that add at most" in run.stderr
    assert len(run.stderr) < 2000 and time.perf_counter() - started < 30


@pytest.mark.parametrize("loader", LOADERS, ids=lambda L: L.__name__)
@pytest.mark.parametrize("text, error", [
    (laughs(), r"its aliases expand its \d+ nodes by more than 1000000 nodes"),
    ("dataset_name_or_path: x\ndata_files: &a [*a]\n", r"the node anchored at line 2, column 13 holds an alias of "
                                                        r"itself"),
    ("a: &a {b: {c: *a}}\n", r"the node anchored at line 1, column 4 holds an alias of itself"),
    ("a: " + "[" * 65 + "]" * 65 + "\n", r"nested more than 64 levels deep"),
    ("a: &x [[[[[[[[1]]]]]]]]\nb: &y [*x, [[[[[[[[*x]]]]]]]]]\n" + "".join(
        f"c{i}: &z{i} [[[[[[[[{'*y' if i == 0 else f'*z{i - 1}'}]]]]]]]]\n" for i in range(6)),
     r"nested more than 64 levels deep \(counted through aliases\)"),
    ("buffer_size: " + "9" * 5000 + "\n", r"a value cannot be read \(Exceeds the limit"),
    ("a: [\n", r"not valid yaml"),
])
def test_hostile_yaml_is_a_config_error_from_either_loader(loader, text, error):
    with pytest.raises(ConfigError, match=r"^T: " + error):
        yaml_files().load_text(text, "T", loader)


def test_the_c_loader_is_used_where_pyyaml_has_it():
    files = yaml_files()
    assert files.LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    text = "a: &x {k: [1, 2.5, null, true, '0x10', 2024-01-02]}\nb: *x\nc: {<<: *x, d: 0o17}\n"
    assert files.load_text(text, "T", yaml.SafeLoader) == files.load_text(text, "T") == yaml.safe_load(text)


def test_self_referencing_alias_in_an_override_is_a_config_error(tmp_path, capsys, data):
    config = _write(tmp_path / "c.yaml", {"dataset_name_or_path": "parquet", "data_files": str(data / "a")})
    code, err = _peek(capsys, config, "data.data_files={train: &a [*a]}")
    assert code == 2 and "override 'data.data_files={train: &a [*a]}': the node anchored at line 1" in err, err
    flow = ", ".join(line.replace(": ", ": ", 1) for line in laughs().splitlines()[2:])   # l0: &l0 [...], ...
    code, err = _peek(capsys, config, f"data.buffer_size={{{flow}}}")
    assert code == 2 and "override 'data.buffer_size={l0: &l0 [" in err and "its aliases expand" in err, err
    assert len(err) < 1500


def test_a_config_file_over_the_size_bound_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(yaml_files(), "MAX_CONFIG_BYTES", 1 << 20)
    path = tmp_path / "big.yaml"
    path.write_text("dataset_name_or_path: parquet\ndata_files:\n" + "- x.parquet\n" * 100_000)   # 1.2 MB
    with pytest.raises(ConfigError, match=rf"config file {str(path)!r}: {path.stat().st_size} bytes; allowed: at "
                                          rf"most {1 << 20} bytes"):
        data_config_from_yaml(str(path))


def test_a_50_mb_yaml_is_refused_in_well_under_a_second(tmp_path):
    """The pure-Python parser took ~60 s on it."""
    path = tmp_path / "big.yaml"
    with open(path, "w") as f:
        f.write("dataset_name_or_path: parquet\ndata_files:\n")
        line = "- " + "x" * 97 + "\n"
        f.write(line * (50_000_000 // len(line)))
    started = time.process_time()
    with pytest.raises(ConfigError, match=r"bytes; allowed: at most 16777216 bytes"):
        StreamConfig.from_yaml(str(path))
    assert time.process_time() - started < 0.5


def test_config_files_that_are_no_regular_files_are_refused(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file"):       # never waits for a writer
        StreamConfig.from_yaml(str(fifo))
    with pytest.raises(ConfigError, match=r"a directory"):
        StreamConfig.from_yaml(str(tmp_path))


def test_error_messages_show_a_huge_value_cut_short_without_expanding_it():
    from resumable_stream.errors import shown

    nested: list = ["lol"] * 9
    for _ in range(9):
        nested = [nested] * 9                     # 9**10 strings if walked
    started = time.perf_counter()
    text = shown(nested)
    assert len(text) <= 200 and text.endswith("...") and time.perf_counter() - started < 0.1
    loop: list = []
    loop.append(loop)
    assert shown(loop) == "[[[[...]]]]"
    assert shown(10 ** 5000) == "<an integer of about 5000 digits>"      # repr() of it is a ValueError
    assert "..." in shown("x" * 10_000) and len(shown("x" * 10_000)) <= 200
    for small in ("data/*.parquet", [1, 2.5, None], {"train": ["a", "b"]}, 10 ** 30, -3):
        assert shown(small) == repr(small)
    with pytest.raises(ConfigError) as e:
        StreamConfig(dataset_name_or_path="x", buffer_size=nested)
    assert len(str(e.value)) < 600
    with pytest.raises(ConfigError, match=r"^data\.'k+\.\.\.k+': unknown key") as e:     # a key of a megabyte
        StreamConfig.from_dict({"dataset_name_or_path": "x", "k" * 10**6: 1})
    assert len(str(e.value)) < 2000


# ------------------------------------------------------------------------------ 4. images
def _png_of(width: int, height: int) -> bytes:
    """A valid grey PNG of width x height zero pixels, compressed row by row: ~100 KB for 10000x10000 (decoded:
    100 MB grey, 300 MB as RGB)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    z = zlib.compressobj(9)
    row = bytes(width + 1)            # filter byte 0, then the row's pixels
    body = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    return _png_of(10_000, 10_000)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")   # Pillow warns at open; we refuse
def test_an_image_over_the_pixel_bound_is_refused_from_its_header(huge_png, monkeypatch, tmp_path):
    """A 100 KB PNG of 10000x10000 pixels (under Pillow's hard limit, which only warns) was decoded in full:
    +1.3 GiB, 12-33 s, then trained on. Now its header is read and the pixels never are."""
    assert len(huge_png) < 200_000
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size))
    from PIL import ImageFile
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size))
    cfg = TransformConfig(format="vl")
    with pytest.raises(BadSample, match=r"image 0 is 10000x10000 = 100000000 pixels, over data.max_image_pixels "
                                        rf"\(null: Pillow's Image.MAX_IMAGE_PIXELS\) {Image.MAX_IMAGE_PIXELS}"):
        decode_image({"bytes": huge_png, "path": None}, 0, cfg)
    small = TransformConfig(format="vl", max_image_pixels=4096, image_dir=str(tmp_path))
    (tmp_path / "a.png").write_bytes(_png_of(65, 64))
    with pytest.raises(BadSample, match=r"image 3 is 65x64 = 4160 pixels, over data.max_image_pixels 4096"):
        decode_image("a.png", 3, small)
    with pytest.raises(BadSample, match=r"image 0 is 65x64 = 4160 pixels"):       # LLaMA-Factory's rows too
        checked_images(["a.png"], small)
    assert decoded == []
    monkeypatch.undo()
    assert decode_image("a.png", 0, small.replace(max_image_pixels=4160)).size == (65, 64)


def test_a_nul_byte_in_an_image_path_and_a_control_character_in_a_url_are_bad_samples(tmp_path):
    cfg = TransformConfig(format="vl", image_dir=str(tmp_path))
    for value in ("a\0b.png", {"bytes": None, "path": "x\0.png"}):
        with pytest.raises(BadSample, match=r"image 0 path '.*' holds a NUL byte"):
            decode_image(value, 0, cfg)
    with pytest.raises(BadSample, match=r"holds a NUL byte"):
        decode_image("/abs\0.png", 0, cfg.replace(allow_absolute_image_paths=True))
    with pytest.raises(BadSample, match=r"holds a NUL byte"):
        checked_images(["a\0b.png"], cfg)
    for url in ("http://127.0.0.1:9/a\0.png", "https://example.invalid/a b.png", "http://h/\r\nHost: x"):
        with pytest.raises(BadSample, match=r"holds a control character or a space"):
            decode_image(url, 0, cfg, RetryPolicy.of())


# ------------------------------------------------------------------------------ 5. set_weights from another thread
def test_set_weights_from_another_thread_than_the_iterating_one_names_the_one_thread_rule(data):
    """It raised "generator already executing", or a "corrupt mixture partition state" that blamed the
    checkpoint."""
    from resumable_stream.errors import WrongThreadError

    cfg = StreamConfig.from_dict(_mixture(data, (1, 1)))
    loader = StreamLoader(MixtureStream(cfg, rank=0, world_size=1), batch_size=4)
    batches = iter(loader)
    next(batches)
    stream = MixtureStream(cfg, rank=0, world_size=1)
    rows = iter(stream)
    next(rows)
    errors = []

    def other_thread():
        for call in (lambda: loader.set_weights({"a": 1, "b": 3}), lambda: stream.set_weights({"a": 1, "b": 3})):
            try:
                call()
            except WrongThreadError as e:
                errors.append(str(e))

    t = threading.Thread(target=other_thread, name="scraper")
    t.start()
    t.join()
    assert len(errors) == 2, errors
    assert errors[0].startswith("StreamLoader.set_weights: called from thread 'scraper' while another thread")
    assert errors[1].startswith("MixtureStream.set_weights: called from thread 'scraper'")
    assert all("one thread owns a stream's cursors: call it from the thread that iterates" in e for e in errors)
    next(batches)                                  # the iterating thread goes on, and may change the weights
    loader.set_weights({"a": 1, "b": 3})
    stream.set_weights({"a": 1, "b": 3})
    assert stream.current_weights() == {"a": 0.25, "b": 0.75} and next(batches)


# ------------------------------------------------------------------------------ 6. a manifest that is a symlink
def _checkpoint(run, step: int) -> str:
    path = run / f"checkpoint-{step}"
    os.makedirs(path / names.STATE_DIR)
    (path / output_dir.TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    return str(path)


def test_a_manifest_that_is_a_symlink_or_no_regular_file_is_no_complete_checkpoint(tmp_path):
    """Such a checkpoint was taken as the newest complete one, ahead of an older good one."""
    good = _checkpoint(tmp_path, 10)
    open(os.path.join(good, names.STATE_DIR, names.MANIFEST), "w").write("{}")
    linked = _checkpoint(tmp_path, 20)
    os.symlink(os.path.join(good, names.STATE_DIR, names.MANIFEST),
               os.path.join(linked, names.STATE_DIR, names.MANIFEST))
    fifo = _checkpoint(tmp_path, 30)
    os.mkfifo(os.path.join(fifo, names.STATE_DIR, names.MANIFEST))
    directory = _checkpoint(tmp_path, 40)
    os.mkdir(os.path.join(directory, names.STATE_DIR, names.MANIFEST))
    assert [output_dir.is_complete(p) for p in (good, linked, fifo, directory)] == [True, False, False, False]
    assert output_dir.latest_complete_checkpoint(str(tmp_path)) == good


def test_a_trainer_state_that_is_a_symlink_is_no_complete_checkpoint(tmp_path):
    good = _checkpoint(tmp_path, 10)
    open(os.path.join(good, names.STATE_DIR, names.MANIFEST), "w").write("{}")
    linked = _checkpoint(tmp_path, 20)
    open(os.path.join(linked, names.STATE_DIR, names.MANIFEST), "w").write("{}")
    os.replace(os.path.join(linked, output_dir.TRAINER_STATE), os.path.join(tmp_path, "elsewhere.json"))
    os.symlink(os.path.join(tmp_path, "elsewhere.json"), os.path.join(linked, output_dir.TRAINER_STATE))
    assert output_dir.latest_complete_checkpoint(str(tmp_path)) == good

