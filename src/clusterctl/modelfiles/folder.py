"""The model folder as every side reads it: which files hold the weights, each safetensors header, the text
model's part of config.json.

One reader of ``model.safetensors.index.json`` for the planner, the rank, the node's preflight and the PLE reader.
The index is optional, as it is for mlx-lm: a folder without one holds its weights in ``*.safetensors``. When it is
there, every file it names must be a plain name in the folder.

One parser of safetensors headers (``parse_safetensors_header``), under the caller's ``HeaderPolicy``: ``STRICT``
for the planner and the rank's weight check (``read_safetensors_header``: duplicate keys, NaN and unknown dtypes
refused, every byte counted), the PLE reader's tolerant one (ple/safetensors.py: unknown dtypes kept, listed and not
gatherable; its own error classes).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Mapping

from clusterctl.atomic import read_capped, strict_loads
from clusterctl.errors import IntegrityError, MissingInput

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


def read_weight_map(index: Path) -> dict[str, str]:
    """``weight_map`` of an index file: tensor name -> shard file name in the same folder (checked: a plain name)."""
    raw = read_capped(index, limit=MAX_INDEX_BYTES, what="weight index", follow_symlinks=True)
    data = strict_loads(raw, source=str(index))
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict):
        raise IntegrityError(f"{index}: no weight_map object")
    out: dict[str, str] = {}
    for name, fname in wm.items():
        if not isinstance(fname, str) or not fname or fname.startswith(".") or "/" in fname or os.sep in fname:
            raise IntegrityError(f"{index}: tensor {str(name)[:80]!r} points at {str(fname)[:80]!r}, "
                                 "not a file of the folder")
        out[str(name)] = fname
    return out


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index names, else every ``*.safetensors``."""
    index = folder / INDEX_NAME
    if index.exists():
        return [folder / n for n in sorted(set(read_weight_map(index).values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingInput(f"{folder}: no *.safetensors files and no {INDEX_NAME}")
    return files


@dataclass(frozen=True)
class HeaderPolicy:
    """What a reader of safetensors headers refuses, and the errors it raises."""

    strict: bool  # JSON parsed strictly (atomic.strict_loads) and a dtype not in ``dtype_bytes`` refused
    dtype_bytes: Mapping[str, int]  # bytes per element of the dtypes whose byte counts are checked
    corrupt: type[IntegrityError] = IntegrityError
    truncated: type[IntegrityError] = IntegrityError  # the file is shorter than its header says


STRICT = HeaderPolicy(strict=True, dtype_bytes=DTYPE_BYTES)


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "begin", "end"}, offsets from ``data_start``
    metadata: dict[str, str]  # ``__metadata__``, when it is an object
    raw: bytes  # the header's JSON bytes, as the file holds them
    data_start: int  # 8 + the header's length


def _read_exact(fd: int, n: int, offset: int, where: str, policy: HeaderPolicy) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise policy.truncated(f"{where}: truncated safetensors file (it ends inside its header)")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def parse_safetensors_header(fd: int, size: int, where: str, policy: HeaderPolicy = STRICT) -> SafetensorsHeader:
    """The header of an open file of ``size`` bytes: an 8-byte little-endian length N, then N bytes of JSON
    (``{name: {dtype, shape, data_offsets}}`` and an optional ``__metadata__``); offsets are relative to byte
    8 + N. Unknown keys are ignored; anything that would read outside the file, or a byte count that does not
    match the shape, is an error (``policy``'s classes)."""
    if size < 8:
        raise policy.truncated(f"{where}: truncated safetensors file ({size} bytes: no header length)")
    (n,) = struct.unpack("<Q", _read_exact(fd, 8, 0, where, policy))
    if n == 0 or n > MAX_HEADER_BYTES:
        raise policy.corrupt(f"{where}: corrupt safetensors header (header length {n}; the limit is "
                             f"{MAX_HEADER_BYTES} bytes: not a safetensors file?)")
    if 8 + n > size:
        raise policy.truncated(f"{where}: truncated safetensors file (header needs {n} bytes, file has {size - 8})")
    raw = _read_exact(fd, n, 8, where, policy)
    if policy.strict:
        header = strict_loads(raw.rstrip(b" "), source=f"safetensors header of {where}")
    else:
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise policy.corrupt(f"{where}: safetensors header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise policy.corrupt(f"{where}: corrupt safetensors header (not an object)")
    tensors: dict[str, dict] = {}
    metadata: dict[str, str] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if isinstance(info, dict):
                metadata = {str(k): str(v) for k, v in info.items()}
            continue
        tensors[name] = _entry(name, info, size - 8 - n, where, policy)
    return SafetensorsHeader(tensors, metadata, raw, 8 + n)


def _entry(name: str, info: object, data_len: int, where: str, policy: HeaderPolicy) -> dict:
    def bad(why: str) -> IntegrityError:
        return policy.corrupt(f"{where}: corrupt safetensors header entry for {name!r}: {why}")

    if not isinstance(info, dict):
        raise bad("not an object")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("dtype is missing")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise bad(f"data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
    begin, end = offs
    if dtype not in policy.dtype_bytes:
        if policy.strict:
            raise policy.corrupt(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
    elif end - begin != prod(shape) * policy.dtype_bytes[dtype]:
        raise policy.corrupt(f"{where}: tensor {name!r} offsets {begin}..{end} do not match {dtype}{shape}")
    if end > data_len:
        raise policy.truncated(f"{where}: truncated safetensors file (tensor {name!r} ends past the end of the file)")
    return {"dtype": dtype, "shape": list(shape), "begin": begin, "end": end}


def read_safetensors_header(path: Path) -> tuple[dict, bytes, int]:
    """Return (tensors, raw header bytes, data start offset), read strictly (the planner and the rank's weight
    check count every byte). Raises IntegrityError on any inconsistency."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = parse_safetensors_header(f.fileno(), size, str(path))
    except FileNotFoundError:
        raise MissingInput(f"weights file not found: {path}") from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read: {e.strerror or e}") from None
    return header.tensors, header.raw, header.data_start


def text_config(config: dict) -> dict:
    """The text model's fields: the top level, or ``text_config`` over it when the top level has no layers."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return {**config, **config["text_config"]}
    return config
