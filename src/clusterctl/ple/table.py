"""Logical tables: one tensor, or one table split by row ranges over several tensors (and files).

``Table.rows(indices)`` equals ``np.concatenate(parts)[indices]`` byte for byte, in the storage dtype. A
``QuantizedTable`` gathers the packed U32 weight rows and their scales/biases rows in one call.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from clusterctl.ple.errors import CorruptTensorFile
from clusterctl.ple.gather import Part
from clusterctl.ple.safetensors import TensorEntry
from clusterctl.ple.shard import ShardFile


class RowSource(Protocol):
    """What a table needs from the reader that made it (``reader.Reader``): the reader's batched, accounted
    reads. Named here so this module does not import the reader, which imports it."""

    def _gather_items(self, items: list) -> list[np.ndarray]: ...
    def _residency(self, table: "Table", indices) -> float: ...
    def _drop_mappings(self, table: "Table", indices) -> None: ...


def as_indices(indices, nrows: int, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Flat int64 row indices and the index shape; IndexError for negative or too large (numpy would wrap)."""
    a = np.asarray(indices)
    if a.dtype.kind not in "iu":
        if a.size:
            raise TypeError(f"row indices must be integers, not {a.dtype}")
        a = a.astype(np.int64)
    flat = a.reshape(-1)
    if flat.size:
        lo, hi = flat.min(), flat.max()
        if lo < 0:
            raise IndexError(f"row index {int(lo)} is negative ({what} has {nrows} rows)")
        if hi >= nrows:
            raise IndexError(f"row index {int(hi)} is out of range ({what} has {nrows} rows)")
    return flat.astype(np.int64, copy=False), a.shape


class Table:
    """Rows of one logical 2-D (or N-D, rows along axis 0) table served from safetensors files."""

    def __init__(self, reader: RowSource, parts: list[tuple[ShardFile, TensorEntry]]):
        if not parts:
            raise ValueError("a table needs at least one tensor")
        e0 = parts[0][1]
        for _, e in parts:
            if not e.supported:
                e.numpy_dtype  # raises CorruptTensorFile with the list of supported dtypes
            if e.dtype != e0.dtype or e.row_shape != e0.row_shape or not e.shape:
                raise CorruptTensorFile(
                    f"tensors {e0.name} {e0.dtype}{list(e0.shape)} and {e.name} {e.dtype}{list(e.shape)} "
                    "cannot form one table (need the same dtype and row shape, at least 1-D)")
        self._reader = reader
        self._parts = parts
        self.names = [e.name for _, e in parts]
        self.name = self.names[0] if len(parts) == 1 else f"{self.names[0]}..{self.names[-1]}"
        self.storage_dtype = e0.dtype
        self.dtype = np.dtype(e0.numpy_dtype)
        self.row_shape = e0.row_shape
        self.row_bytes = e0.row_bytes
        sizes = [e.nrows for _, e in parts]
        self.nrows = sum(sizes)
        self._starts = np.cumsum([0] + sizes, dtype=np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.nrows, *self.row_shape)

    def __len__(self) -> int:
        return self.nrows

    def __repr__(self) -> str:
        return f"Table({self.name!r}, shape={self.shape}, dtype={self.storage_dtype})"

    def rows(self, indices, out: np.ndarray | None = None) -> np.ndarray:
        """Rows in request order (duplicates repeated), C-contiguous, in the storage dtype (BF16 as uint16)."""
        return self._reader._gather_items([(self, indices, out)])[0]

    def embedding(self, ids) -> np.ndarray:
        """``rows(ids)``: the call an nn.Embedding replacement makes (shape ids.shape + row shape)."""
        return self.rows(ids)

    def residency(self, indices) -> float:
        """Fraction of the pages of these rows that are in the page cache now (mincore on just those pages)."""
        return self._reader._residency(self, indices)

    def drop_mappings(self, indices=None) -> None:
        """Drop this process's page-table entries of the pages of these rows (all rows if None)."""
        self._reader._drop_mappings(self, indices)

    # -- used by Reader._gather_items ----------------------------------------------------------------------------
    def _prepare(self, indices, out):
        flat, ishape = as_indices(indices, self.nrows, self.name)
        shape = ishape + self.row_shape
        if out is None:
            out = np.empty(shape, dtype=self.dtype)
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError("out must be a numpy array")
            if out.dtype != self.dtype or out.shape != shape:
                raise ValueError(f"out must have shape {shape} and dtype {self.dtype}, not {out.shape} {out.dtype}")
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out must be C-contiguous and writeable")
        return flat, out

    def _make_parts(self, flat: np.ndarray, out: np.ndarray) -> list[Part]:
        n = flat.size
        if n == 0 or self.row_bytes == 0:
            return []
        out2d = out.reshape(-1).view(np.uint8).reshape(n, self.row_bytes)
        if len(self._parts) == 1:
            shard, e = self._parts[0]
            return [Part(shard, e, flat, out2d, None)]
        which = np.searchsorted(self._starts, flat, side="right") - 1
        present = np.unique(which)
        if present.size == 1:  # all rows in one part: straight into out, no scatter
            k = int(present[0])
            shard, e = self._parts[k]
            return [Part(shard, e, flat - self._starts[k], out2d, None)]
        parts = []
        for k in present.tolist():
            sel = np.flatnonzero(which == k)
            shard, e = self._parts[k]
            parts.append(Part(shard, e, flat[sel] - self._starts[k], out2d, sel))
        return parts

    def _rows_by_part(self, flat: np.ndarray):
        which = np.searchsorted(self._starts, flat, side="right") - 1
        for k in np.unique(which).tolist():
            shard, e = self._parts[k]
            yield shard, e, flat[which == k] - self._starts[k]


class QuantizedRows(NamedTuple):
    weight: np.ndarray  # packed U32
    scales: np.ndarray
    biases: np.ndarray | None


class QuantizedTable:
    """An MLX-style quantized table: ``<base>.weight`` (U32 packed), ``<base>.scales``, ``<base>.biases``."""

    def __init__(self, reader: RowSource, weight: Table, scales: Table, biases: Table | None):
        for t in (scales, biases):
            if t is not None and t.nrows != weight.nrows:
                raise CorruptTensorFile(f"{t.name} has {t.nrows} rows but {weight.name} has {weight.nrows}")
        self._reader = reader
        self.weight, self.scales, self.biases = weight, scales, biases
        self.name = weight.name
        self.nrows = weight.nrows

    def __len__(self) -> int:
        return self.nrows

    def __repr__(self) -> str:
        return f"QuantizedTable({self.name!r}, rows={self.nrows})"

    def tables(self) -> list[Table]:
        return [t for t in (self.weight, self.scales, self.biases) if t is not None]

    def rows(self, indices, out: QuantizedRows | tuple | None = None) -> QuantizedRows:
        """The packed weight rows with their scales and biases rows, all gathered in one call."""
        outs = list(out) if out is not None else [None, None, None]
        got = self._reader._gather_items([(t, indices, o) for t, o in zip(self.tables(), outs)])
        return QuantizedRows(got[0], got[1], got[2] if self.biases is not None else None)

    def embedding(self, ids) -> QuantizedRows:
        return self.rows(ids)
