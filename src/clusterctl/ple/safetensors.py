"""Safetensors headers and sharded indexes, read tolerantly but bounds-checked.

The header is parsed by the one parser of the format (modelfiles/folder.py ``parse_safetensors_header``) under the
reader's policy: unknown keys are ignored and unknown dtypes are kept (listed, not gatherable); anything that would
make us read outside the file, or a byte count that does not match the shape, is a CorruptTensorFile (a
TruncatedTensorFile when the file is shorter than its header says).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.ple.errors import CorruptTensorFile, TensorNotFound, TruncatedTensorFile
from clusterctl.modelfiles.folder import INDEX_NAME, read_weight_map  # noqa: F401
from clusterctl.modelfiles.folder import HeaderPolicy, parse_safetensors_header

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


# the reader's policy: unknown dtypes kept; the byte counts of those it knows checked; its own error classes
TOLERANT = HeaderPolicy(strict=False, dtype_bytes={d: size for d, (size, _) in DTYPES.items()},
                        corrupt=CorruptTensorFile, truncated=TruncatedTensorFile)


def parse_header(fd: int, path: str, size: int) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Read and check the header of an open file of ``size`` bytes: (entries by name, metadata)."""
    header = parse_safetensors_header(fd, size, path, TOLERANT)
    base = header.data_start
    entries = {name: TensorEntry(name, t["dtype"], tuple(t["shape"]), base + t["begin"], t["end"] - t["begin"], path)
               for name, t in header.tensors.items()}
    return entries, header.metadata


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json`` (modelfiles/folder.py), in the reader's errors."""
    try:
        return read_weight_map(path)
    except MissingInput as e:
        raise TensorNotFound(str(e)) from None
    except IntegrityError as e:
        raise CorruptTensorFile(str(e)) from None
