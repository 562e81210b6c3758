"""Rows of huge tables (per-layer embeddings, n-gram banks) gathered from safetensors files on SSD.

No MLX here: rows come back as numpy arrays in the storage dtype. See docs/ple.md.
"""

from clusterctl.ple.errors import (
    CorruptTensorFile,
    ReaderClosed,
    TensorFileChanged,
    TensorNotFound,
    TruncatedTensorFile,
)
from clusterctl.ple.reader import Reader, open_reader
from clusterctl.ple.safetensors import TensorEntry
from clusterctl.ple.table import QuantizedRows, QuantizedTable, Table

__all__ = [
    "CorruptTensorFile", "QuantizedRows", "QuantizedTable", "Reader", "ReaderClosed", "Table", "TensorEntry",
    "TensorFileChanged", "TensorNotFound", "TruncatedTensorFile", "open_reader",
]
