"""A small safetensors writer (numpy only) and page-cache helpers for the PLE reader tests.

Imported by name (``from stfiles import ...``); conftest.py holds only fixtures, so any subset of the suite
collects (two modules called ``conftest`` would shadow each other).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from clusterctl.ple.residency import PAGE, evict, file_pages, file_residency

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


def evict_verified(reader, *paths, attempts: int = 20) -> bool:
    """Drop the reader's mappings and the files' cached pages; True once mincore shows nothing resident.

    One POSIX_FADV_DONTNEED can leave a few pages behind while the kernel still holds them in per-CPU LRU batches
    (seen about once in a hundred tries with both cores busy), so it is retried with a short back-off."""
    for attempt in range(attempts):
        if reader is not None:
            reader.drop_mappings()
        for p in paths:
            evict(p)
        if all(file_residency(p)[0] == 0 for p in paths):
            return True
        time.sleep(0.002 * (attempt + 1))
    return False


def make_cold(reader, *paths) -> None:
    """Evict the files or skip the test: a cold-read test must never pass or fail by what the page cache kept."""
    if not evict_verified(reader, *paths):
        left = {str(p): file_residency(p)[0] for p in paths}
        pytest.skip(f"cannot verify eviction of the page cache (pages still resident: {left})")


def prime_pages(path, offsets) -> None:
    """Bring exactly the page holding each byte offset into the page cache, with no readahead around it.

    A plain read on a fresh descriptor may let the kernel read ahead of the asked byte (read_ahead_kb is 8 MiB on
    these virtio disks, and ext4 caches large folios), which would cache whole rows; POSIX_FADV_RANDOM on the
    priming descriptor makes the kernel read just the page that was asked for."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            os.pread(fd, 1, int(off))
    finally:
        os.close(fd)


def page_map(path, start: int, row_bytes: int, rows) -> list[str]:
    """Per row, its pages as a string of 1 (resident) and 0 (not), from one mincore over the file."""
    res = file_pages(path)
    out = []
    for i in rows:
        a = (start + int(i) * row_bytes) // PAGE
        b = (start + (int(i) + 1) * row_bytes - 1) // PAGE
        out.append("".join("1" if x else "0" for x in res[a:b + 1]))
    return out
