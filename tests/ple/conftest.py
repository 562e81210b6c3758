"""A small safetensors writer (numpy only) and page-cache helpers for the PLE reader tests."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from clusterctl.ple.residency import PAGE, evict, file_residency

NUMPY = {"F64": "<f8", "I64": "<i8", "U64": "<u8", "F32": "<f4", "I32": "<i4", "U32": "<u4", "F16": "<f2",
         "BF16": "<u2", "I16": "<i2", "U16": "<u2", "I8": "|i1", "U8": "|u1", "BOOL": "|b1", "F8_E4M3": "|u1"}


def random_tensor(rng: np.random.Generator, dtype: str, shape) -> np.ndarray:
    """Random bytes viewed in the storage dtype (every bit pattern, NaNs included)."""
    dt = np.dtype(NUMPY[dtype])
    n = int(np.prod(shape)) * dt.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(dt).reshape(shape)


def write_safetensors(path: Path, tensors: dict, *, pad: int = 0, gap: int = 0, metadata: dict | None = None) -> Path:
    """tensors: name -> (safetensors dtype, array in storage dtype). ``pad`` spaces after the JSON move the data
    start (unaligned on purpose); ``gap`` junk bytes between tensors move each tensor's start."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    blobs = []
    off = 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        blobs.append(b"\xa5" * gap)
        off += len(b) + gap
    js = json.dumps(header).encode() + b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    return path


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def evict_verified(reader, *paths) -> bool:
    """Drop the reader's mappings and the files' cached pages; True if mincore then shows nothing resident."""
    if reader is not None:
        reader.drop_mappings()
    for p in paths:
        evict(p)
    return all(file_residency(p)[0] == 0 for p in paths)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def can_evict(tmp_path):
    """Skip when this filesystem keeps pages after POSIX_FADV_DONTNEED (e.g. tmpfs)."""
    p = tmp_path / "probe.bin"
    p.write_bytes(os.urandom(4 * PAGE))
    with open(p, "rb") as f:
        os.fsync(f.fileno())
        f.read()
    evict(p)
    if file_residency(p)[0] != 0:
        pytest.skip(f"cannot evict pages of files under {tmp_path} (tmpfs?)")
    return True
