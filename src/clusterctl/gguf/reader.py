"""Reading the header of a GGUF file (llama.cpp's single-file model format) without trusting it.

``read_header(path)`` returns the metadata (key -> Python value) and the tensor table (name, shape, GGML type,
byte range). Every length and count is checked against the file's size before it is used (and against a
fixed cap: a multi-GB file must not make a 4-million-entry array of empty strings cost gigabytes of Python
objects), so a file that is not GGUF, is truncated or has a damaged header gives an IntegrityError naming what
is wrong before anything is built from it and before any tensor is loaded. The tensor types matter before
loading too: ``mx.load`` (mlx 0.32.4) silently dequantizes the types it has no quantized form for (Q4_K, Q6_K,
BF16 ...) to float16, and ends the process on a FLOAT64 metadata value (``value_types`` records each key's type).

Layout (little-endian, versions 2 and 3): magic ``GGUF``, version u32, tensor count u64, metadata count u64;
the metadata (key string, value type u32, value); the tensor infos (name, n_dims u32, dims u64 innermost
first, type u32, offset u64 relative to the data section); the data section, aligned to
``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterctl.atomic import open_regular
from clusterctl.errors import IntegrityError

MAGIC = b"GGUF"
MAX_COUNT = 1 << 20  # tensors or metadata keys: real models have a few thousand
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY = 1 << 22  # entries of one metadata array: the largest vocabularies (and their merges) have ~262,000
MAX_ITEMS = 1 << 23  # array entries of all the metadata together
MAX_KEY = 1 << 16  # bytes of a metadata key (GGUF's own limit)
MAX_NAME = 256  # bytes of a tensor name (llama.cpp's GGML_MAX_NAME is 64)
# the fewest bytes one metadata key or one tensor info can take: a key of 0 bytes, its type and a 1-byte
# value; a name of 0 bytes, n_dims, one dimension, type and offset
MIN_KEY_BYTES, MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8

# GGML tensor types: name, (elements per block, bytes per block) where the importer needs the size.
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
    "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
    "Q5_K": (256, 176), "Q6_K": (256, 210), "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "F64": (1, 8),
}

# metadata value types: struct format of a scalar (strings and arrays are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first, as MLX and numpy see it (GGUF stores the innermost first)
    type: str  # GGML type name, "type N" when unknown
    offset: int  # absolute byte offset in the file
    nbytes: int | None  # None for a type whose block size this reader does not know

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    value_types: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key -> (type,) or (9, element type)


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)
        self.items = 0  # metadata array entries read so far (MAX_ITEMS)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise IntegrityError(f"{self.path} is truncated or damaged: {what} runs past the end of the file "
                                 f"(at byte {self.pos}, file size {self.size})")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("<Q", what)
        if limit is not None and n > limit:
            raise IntegrityError(f"{self.path}: {what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise IntegrityError(f"{self.path}: {what} is not UTF-8 text") from None


def _value(c: _Cursor, vtype: int, key: str):
    if vtype in _SCALARS:
        return c.unpack(_SCALARS[vtype], f"metadata {key!r}")
    if vtype == _STRING:
        return c.string(f"metadata {key!r}")
    if vtype == _ARRAY:
        etype, count = c.unpack("<IQ", f"metadata {key!r}")
        c.items += count
        if count > MAX_ARRAY or c.items > MAX_ITEMS:
            raise IntegrityError(f"{c.path}: metadata {key!r} is an array of {count} entries (at most {MAX_ARRAY}, "
                                 f"{MAX_ITEMS} in all arrays)")
        if etype == _STRING:
            c.need(count * 8, f"metadata {key!r}")  # each string has at least its 8-byte length
            return [c.string(f"metadata {key!r}") for _ in range(count)]
        if etype in _NUMPY:
            import numpy as np

            n = count * struct.calcsize(_SCALARS[etype])
            c.need(n, f"metadata {key!r}")
            arr = np.frombuffer(c.buf, dtype=_NUMPY[etype], count=count, offset=c.pos)
            c.pos += n
            return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
        raise IntegrityError(f"{c.path}: metadata {key!r} is an array of type {etype}, which GGUF does not define "
                             f"(or a nested array)")
    raise IntegrityError(f"{c.path}: metadata {key!r} has value type {vtype}, which GGUF does not define")


def read_header(path: str | os.PathLike) -> Header:
    """The metadata and tensor table of a GGUF file, checked against its size (IntegrityError otherwise)."""
    path = Path(path)
    fd, st = open_regular(path, what="GGUF file", follow_symlinks=True)
    try:
        if st.st_size < 24:
            raise IntegrityError(f"{path} is not a GGUF file ({st.st_size} bytes)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, path, st.st_size)
    except OSError as e:
        raise IntegrityError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _parse(buf, path: Path, size: int) -> Header:
    c = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise IntegrityError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    c.pos = 4
    version = c.unpack("<I", "version")
    if version not in (2, 3):
        raise IntegrityError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                             f"shows a huge version)")
    n_tensors, n_kv = c.unpack("<QQ", "header")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise IntegrityError(f"{path}: damaged header ({n_tensors} tensors, {n_kv} metadata keys)")
    if c.pos + n_kv * MIN_KEY_BYTES + n_tensors * MIN_TENSOR_BYTES > size:
        raise IntegrityError(f"{path} is truncated or damaged: its header lists {n_tensors} tensors and {n_kv} "
                             f"metadata keys, more than a file of {size} bytes can hold")
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}
    for _ in range(n_kv):
        key = c.string("a metadata key", MAX_KEY)
        vtype = c.unpack("<I", f"metadata {key!r}")
        if key in metadata:
            raise IntegrityError(f"{path}: metadata key {key!r} appears twice")
        if vtype == _ARRAY:
            types[key] = (vtype, struct.unpack_from("<I", buf, c.pos)[0] if c.pos + 4 <= size else -1)
        else:
            types[key] = (vtype,)
        metadata[key] = _value(c, vtype, key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name", MAX_NAME)
        ndim = c.unpack("<I", f"tensor {name!r}")
        if not 1 <= ndim <= MAX_DIMS:
            raise IntegrityError(f"{path}: tensor {name!r} has {ndim} dimensions")
        dims = c.unpack(f"<{ndim}Q", f"tensor {name!r}")
        dims = (dims,) if ndim == 1 else dims
        gtype, offset = c.unpack("<IQ", f"tensor {name!r}")
        infos.append((name, tuple(reversed(dims)), gtype, offset))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise IntegrityError(f"{path}: general.alignment {align!r} is not a power of two")
    data = -(-c.pos // align) * align
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, gtype, offset in infos:
        if name in seen:
            raise IntegrityError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        tname = GGML_TYPES.get(gtype, f"type {gtype}")
        nbytes = None
        if tname in BLOCKS:
            per, bsize = BLOCKS[tname]
            elements = 1
            for d in shape:
                elements *= d
            if shape[-1] % per:
                raise IntegrityError(f"{path}: tensor {name!r} ({tname}) has a row of {shape[-1]} values, not a "
                                     f"multiple of its block of {per}")
            nbytes = elements // per * bsize
            if offset % align or data + offset + nbytes > size:
                raise IntegrityError(f"{path} is truncated or damaged: tensor {name!r} ends at byte "
                                     f"{data + offset + nbytes}, the file has {size}")
        tensors.append(TensorInfo(name=name, shape=shape, type=tname, offset=data + offset, nbytes=nbytes))
    return Header(version=version, metadata=metadata, tensors=tensors, data_offset=data, file_size=size,
                  value_types=types)
