"""One open safetensors file: descriptor, read-only mapping, header entries and the map of pages seen resident.

Warm rows are gathered from the mapping; it is advised MADV_RANDOM (no readahead on faults) and the descriptor
POSIX_FADV_RANDOM (reads and RWF_NOWAIT probes fetch exactly the bytes asked). "Seen" pages carry the generation
they were verified in; a recovery bumps the generation, which forgets them all in O(1).
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from clusterctl.atomic import open_regular
from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.ple.errors import CorruptTensorFile, TensorFileChanged, TensorNotFound, TruncatedTensorFile
from clusterctl.ple.residency import PAGE, PAGE_SHIFT, mincore
from clusterctl.ple.safetensors import TensorEntry, parse_header


class ShardFile:
    def __init__(self, path: str):
        self.path = path
        try:  # follows a symlink on purpose: model caches link their files to blobs
            fd, st = open_regular(path, what="shard file", follow_symlinks=True)
        except MissingInput as e:
            raise TensorNotFound(str(e)) from None
        except IntegrityError as e:
            raise CorruptTensorFile(str(e)) from None
        try:
            self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
            self.entries, self.metadata = parse_header(fd, path, self.size)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            try:
                self._mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
            except (ValueError, OSError) as e:  # e.g. the file shrank since the fstat above
                raise TruncatedTensorFile(f"{path}: cannot map {self.size} bytes ({e}); truncated while opening?") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        if hasattr(mmap, "MADV_RANDOM"):
            self._mm.madvise(mmap.MADV_RANDOM)
        self._u8 = np.frombuffer(self._mm, dtype=np.uint8)
        self.base = self._u8.ctypes.data
        self._seen = np.zeros((self.size + PAGE - 1) // PAGE, dtype=np.uint8)
        self._gen = 1
        self._views: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        self._lock = threading.Lock()

    # -- integrity ---------------------------------------------------------------------------------------------
    def check_unchanged(self) -> None:
        """One fstat per call: a shrunk file would turn mapped reads into SIGBUS, a rewritten one into wrong rows."""
        st = os.fstat(self.fd)
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            what = (f"size {self.size} -> {st.st_size} bytes" if st.st_size != self.size
                    else "modified in place")
            raise TensorFileChanged(f"{self.path} changed since it was opened ({what}); reopen the reader",
                                    hint="a shard must not be rewritten while a reader has it open")

    def view(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's rows as a (nrows, row_bytes) uint8 view of the mapping (uint8, so never unaligned)."""
        v = self._views.get(entry.name)
        if v is None:
            rb = entry.row_bytes
            v = self._u8[entry.start:entry.start + entry.nrows * rb].reshape(entry.nrows, rb)
            self._views[entry.name] = v
        return v

    # -- pages seen resident -------------------------------------------------------------------------------------
    @staticmethod
    def _pages(offs: np.ndarray, rb: int):
        first = offs >> PAGE_SHIFT
        last = (offs + (rb - 1)) >> PAGE_SHIFT
        if rb <= PAGE:
            return first, last, None
        k = int((last - first).max()) + 1
        return first, last, np.minimum(first[:, None] + np.arange(k), last[:, None])

    def all_seen(self, offs: np.ndarray, rb: int) -> bool:
        """Were all pages of all these rows verified in the current generation? (Entries never exceed it.)"""
        g = self._gen
        if rb <= PAGE:
            first = offs >> PAGE_SHIFT
            last = offs + (rb - 1)
            last >>= PAGE_SHIFT
            return bool(self._seen.take(first).min() == g and self._seen.take(last).min() == g)
        return bool(self._seen[self._pages(offs, rb)[2]].min() == g)

    def seen(self, offs: np.ndarray, rb: int) -> np.ndarray:
        """Per row: were all its pages verified resident in the current generation?"""
        g = self._gen
        first, last, span = self._pages(offs, rb)
        if span is None:
            return (self._seen[first] == g) & (self._seen[last] == g)
        return (self._seen[span] == g).all(axis=1)

    def mark_seen(self, offs: np.ndarray, rb: int) -> None:
        g = self._gen
        first, last, span = self._pages(offs, rb)
        if span is None:
            self._seen[first] = g
            self._seen[last] = g
        else:
            self._seen[span] = g

    def forget(self) -> None:
        """Forget every seen page (after a major fault showed the page cache lost some)."""
        with self._lock:
            if self._gen == 255:
                self._seen.fill(0)
                self._gen = 1
            else:
                self._gen += 1

    def resident(self, offs: np.ndarray, rb: int) -> tuple[int, int]:
        """(resident, needed) pages of these rows, by mincore on just those pages (runs of consecutive pages)."""
        first, last, span = self._pages(offs, rb)
        pages = np.unique(np.concatenate([first, last]) if span is None else span.ravel())
        if pages.size == 0:
            return 0, 0
        brk = np.flatnonzero(np.diff(pages) != 1) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [pages.size]])
        res = 0
        for a, b in zip(starts.tolist(), ends.tolist()):
            p0 = int(pages[a])
            res += int(mincore(self.base + p0 * PAGE, (b - a) * PAGE).sum())
        return res, int(pages.size)

    def drop_mappings(self, offs: np.ndarray | None = None, rb: int = 0) -> None:
        """Drop this process's page-table entries, of every page or of the pages of the rows at ``offs`` (the
        page cache keeps the data; the kernel may now evict it)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        if offs is None:
            self._mm.madvise(mmap.MADV_DONTNEED)
            return
        first, last, span = self._pages(offs, rb)
        for p in np.unique(np.concatenate([first, last]) if span is None else span.ravel()).tolist():
            self._mm.madvise(mmap.MADV_DONTNEED, p * PAGE, min(PAGE, self.size - p * PAGE))

    def close(self) -> None:
        self._views.clear()
        self._u8 = None
        try:
            self._mm.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with the last one
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1
