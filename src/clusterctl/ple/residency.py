"""What the page cache holds, asked of the kernel: mincore, the thread's major-fault counter, eviction.

The reader never guesses residency from timings. It probes unseen rows with RWF_NOWAIT reads (or reads them),
and it trusts pages it has seen only for as long as the kernel's major-fault counter of the gathering thread
stays still: a major fault means a page had to come from the device, i.e. something was evicted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PAGE_SHIFT = PAGE.bit_length() - 1  # pages are powers of two (4 KiB here, 16 KiB on Apple silicon)

_libc = None
_mincore = None


def _load_mincore():
    global _libc, _mincore
    if _mincore is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = _libc.mincore
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _mincore = fn
    return _mincore


def mincore(addr: int, length: int):
    """Residency of the pages of a mapped range [addr, addr+length) (addr page-aligned): a bool ndarray."""
    import numpy as np

    n = (length + PAGE - 1) // PAGE
    vec = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return vec.astype(bool)
    if _load_mincore()(addr, length, vec.ctypes.data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mincore: {os.strerror(e)}")
    return (vec & 1).astype(bool)


_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def major_faults() -> int:
    """Major page faults so far of the calling thread (of the process where there is no per-thread count)."""
    return resource.getrusage(_RUSAGE_WHO).ru_majflt


PER_THREAD_FAULTS = _RUSAGE_WHO != resource.RUSAGE_SELF


def file_pages(path: str | os.PathLike):
    """Residency of every page of a whole file (a bool ndarray), via a short-lived mapping and one mincore call."""
    import mmap

    import numpy as np

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=bool)
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            view = np.frombuffer(mm, dtype=np.uint8)
            res = mincore(view.ctypes.data, size)
            del view
        finally:
            mm.close()
        return res
    finally:
        os.close(fd)


def file_residency(path: str | os.PathLike) -> tuple[int, int]:
    """(resident pages, total pages) of a whole file."""
    res = file_pages(path)
    return int(res.sum()), len(res)


def evict(path: str | os.PathLike, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop clean cached pages of a file range (0 = to the end).

    Pages still mapped by a live mapping that touched them stay (unmap or MADV_DONTNEED first), and a large folio
    is dropped only when the whole folio is inside the range: check with mincore afterwards.
    """
    if not hasattr(os, "posix_fadvise"):
        raise OSError(f"posix_fadvise is not available on {sys.platform}")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
