"""WebDataset tars for the tests: members of several kinds, written with tarfile."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np


def png(i: int, side: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (i % 256, (7 * i) % 256, 99)).save(buf, format="PNG")
    return buf.getvalue()


def jpg(i: int, side: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), ((3 * i) % 256, 50, i % 256)).save(buf, format="JPEG")
    return buf.getvalue()


def npy(i: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.arange(3, dtype=np.int64) + i, allow_pickle=False)
    return buf.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: str, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key, members in samples:
            for suffix, data in members.items():
                add(tar, f"{key}.{suffix}", data)
    return path


def text_samples(file: int, n: int) -> list[tuple[str, dict[str, bytes]]]:
    """The issue's case: a .txt and a .json member per sample."""
    return [(f"f{file}/s{i:05d}", {"txt": f"text {file} {i}".encode(),
                                   "json": json.dumps({"i": i, "file": file}).encode()}) for i in range(n)]


def mixed_samples(file: int, n: int) -> list[tuple[str, dict[str, bytes]]]:
    """Images, text, json, cls and npy members; after the first 5 (what features are inferred from) some
    samples miss a member, others carry one more."""
    out = []
    for i in range(n):
        members = {"jpg": jpg(i), "png": png(i), "txt": f"caption {file}-{i}".encode(),
                   "json": json.dumps({"n": i, "tags": ["a", str(i)]}).encode(), "cls": str(i % 7).encode(),
                   "npy": npy(i)}
        if i > 5 and i % 5 == 0:
            del members["json"]
        if i > 5 and i % 7 == 0:
            members["extra.txt"] = b"more"
        out.append((f"k{file}_{i:04d}", members))
    return out


def write_tars(directory, count: int, n: int, kind=text_samples) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [write_tar(os.path.join(str(directory), f"shard-{f:03d}.tar"), kind(f, n)) for f in range(count)]
