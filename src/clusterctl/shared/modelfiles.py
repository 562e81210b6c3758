"""The model folder as every side reads it: which files hold the weights, each safetensors header, the text
model's part of config.json.

One reader of ``model.safetensors.index.json`` for the planner, the rank, the node's preflight and the PLE reader.
The index is optional, as it is for mlx-lm: a folder without one holds its weights in ``*.safetensors``. When it is
there, every file it names must be a plain name in the folder.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

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


def read_safetensors_header(path: Path) -> tuple[dict, bytes, int]:
    """Return (tensors, raw header bytes, data start offset). Raises IntegrityError on any inconsistency."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise IntegrityError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise IntegrityError(f"{path}: corrupt safetensors header (header length {n})")
            if 8 + n > size:
                raise IntegrityError(f"{path}: truncated safetensors file (header needs {n} bytes, file has {size - 8})")
            raw = f.read(n)
    except FileNotFoundError:
        raise MissingInput(f"weights file not found: {path}") from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read: {e.strerror or e}") from None
    header = strict_loads(raw.rstrip(b" "), source=f"safetensors header of {path}")
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: corrupt safetensors header (not an object)")
    data_len = size - 8 - n
    tensors: dict[str, dict] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        def ints(v) -> bool:
            return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not ints(info.get("shape")) \
                or not ints(info.get("data_offsets")) or len(info["data_offsets"]) != 2:
            raise IntegrityError(f"{path}: corrupt safetensors header entry for {name!r}")
        dtype, shape = info["dtype"], list(info["shape"])
        begin, end = info["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise IntegrityError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        count = 1
        for d in shape:
            if d < 0:
                raise IntegrityError(f"{path}: tensor {name!r} has a negative dimension")
            count *= d
        if not 0 <= begin <= end or end - begin != count * DTYPE_BYTES[dtype]:
            raise IntegrityError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match {dtype}{shape}")
        if end > data_len:
            raise IntegrityError(f"{path}: truncated safetensors file (tensor {name!r} ends past the end of the file)")
        tensors[name] = {"dtype": dtype, "shape": shape, "begin": begin, "end": end}
    return tensors, raw, 8 + n



def text_config(config: dict) -> dict:
    """The text model's fields: the top level, or ``text_config`` over it when the top level has no layers."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return {**config, **config["text_config"]}
    return config
