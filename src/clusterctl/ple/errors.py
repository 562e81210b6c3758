"""Errors of the PLE reader: each is a ClusterctlError subclass with a one-line message."""

from __future__ import annotations

from clusterctl.errors import ClusterctlError, IntegrityError, MissingInput


class CorruptTensorFile(IntegrityError):
    """A safetensors file or index whose header, offsets or dtype do not make sense."""


class TruncatedTensorFile(CorruptTensorFile):
    """A file shorter than its header says, or a read that met end-of-file inside a tensor."""


class TensorFileChanged(IntegrityError):
    """A shard file was truncated, extended or rewritten after the reader opened it."""


class TensorNotFound(MissingInput):
    """A tensor name that is not in the checkpoint (or a shard file named by the index that is missing)."""


class ReaderClosed(ClusterctlError):
    """The reader was used after close()."""
