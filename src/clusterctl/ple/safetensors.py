"""Safetensors headers and sharded indexes, read tolerantly but bounds-checked.

A file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {dtype, shape, data_offsets}}``
plus an optional ``__metadata__``), then the data; offsets are relative to byte 8 + N. Unknown keys are ignored
and unknown dtypes are kept (listed, not gatherable); anything that would make us read outside the file, or a
byte count that does not match the shape, is a CorruptTensorFile.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.ple.errors import CorruptTensorFile, TensorNotFound, TruncatedTensorFile
from clusterctl.shared.modelfiles import INDEX_NAME, MAX_HEADER_BYTES, read_weight_map  # noqa: F401

# storage dtype -> (bytes per element, numpy dtype string that keeps the stored bytes as they are)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "<f8"), "I64": (8, "<i8"), "U64": (8, "<u8"),
    "F32": (4, "<f4"), "I32": (4, "<i4"), "U32": (4, "<u4"),
    "F16": (2, "<f2"), "BF16": (2, "<u2"), "I16": (2, "<i2"), "U16": (2, "<u2"),
    "I8": (1, "|i1"), "U8": (1, "|u1"), "BOOL": (1, "|b1"),
    "F8_E4M3": (1, "|u1"), "F8_E5M2": (1, "|u1"), "F8_E8M0": (1, "|u1"),
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of one file: where its bytes are and how to view them."""

    name: str
    dtype: str  # as stored, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element in the file
    nbytes: int
    path: str

    @property
    def supported(self) -> bool:
        return self.dtype in DTYPES

    @property
    def numpy_dtype(self) -> str:
        """numpy dtype of the stored bytes (BF16 and FP8 come back as raw unsigned integers)."""
        if self.dtype not in DTYPES:
            raise CorruptTensorFile(f"{self.path}: tensor {self.name} has dtype {self.dtype}, which the reader "
                                    "cannot gather (supported: " + ", ".join(sorted(DTYPES)) + ")")
        return DTYPES[self.dtype][1]

    @property
    def nrows(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_bytes(self) -> int:
        return prod(self.shape[1:]) * DTYPES[self.dtype][0] if self.dtype in DTYPES else 0


def _read_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    chunks = []
    got = 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise TruncatedTensorFile(f"{path}: file ends inside its safetensors header")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def parse_header(fd: int, path: str, size: int) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Read and check the header of an open file of ``size`` bytes: (entries by name, metadata)."""
    if size < 8:
        raise TruncatedTensorFile(f"{path}: {size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", _read_exact(fd, 8, 0, path))
    if n > MAX_HEADER_BYTES:
        raise CorruptTensorFile(f"{path}: header length {n} is over the {MAX_HEADER_BYTES}-byte limit "
                                "(not a safetensors file?)")
    if 8 + n > size:
        raise TruncatedTensorFile(f"{path}: header of {n} bytes does not fit in the {size}-byte file")
    raw = _read_exact(fd, n, 8, path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptTensorFile(f"{path}: safetensors header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CorruptTensorFile(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    entries: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            if isinstance(spec, dict):
                metadata = {str(k): str(v) for k, v in spec.items()}
            continue
        entries[name] = _entry(name, spec, base, size, path)
    return entries, metadata


def _entry(name: str, spec: object, base: int, size: int, path: str) -> TensorEntry:
    def bad(why: str) -> CorruptTensorFile:
        return CorruptTensorFile(f"{path}: tensor {name!r}: {why}")

    if not isinstance(spec, dict):
        raise bad("entry is not an object")
    dtype, shape, offs = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("dtype is missing")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise bad(f"data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
    nbytes = offs[1] - offs[0]
    if dtype in DTYPES and nbytes != prod(shape) * DTYPES[dtype][0]:
        raise bad(f"{nbytes} bytes do not hold shape {shape} of {dtype}")
    if base + offs[1] > size:
        raise TruncatedTensorFile(f"{path}: tensor {name!r} ends at byte {base + offs[1]} but the file has "
                                  f"{size} bytes")
    return TensorEntry(name, dtype, tuple(shape), base + offs[0], nbytes, path)


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json`` (shared/modelfiles.py), in the reader's errors."""
    try:
        return read_weight_map(path)
    except MissingInput as e:
        raise TensorNotFound(str(e)) from None
    except IntegrityError as e:
        raise CorruptTensorFile(str(e)) from None
