"""Cold reads: rows that are not known to be in the page cache, read straight into the caller's buffer.

The rows of one call (all shards together) are deduplicated, offset-sorted and coalesced into runs: one
``preadv`` per run of neighbouring rows, scattering into the output rows (small gaps go to a scratch buffer).
Three mechanisms, chosen per platform and overridable:

- ``nowait`` (Linux): ``preadv(RWF_NOWAIT)`` per run copies a cached run at once, or fails with EAGAIN *after
  starting its read* -- a residency probe and a prefetch in one call. Up to ``window`` runs are in flight; the
  oldest is then completed with a blocking ``preadv`` (which finds its pages arriving). When the first 32 probes
  find less than a quarter cached, the rest of the call is advised WILLNEED instead (a failed call costs more).
- ``fadvise`` (Linux/BSD without RWF_NOWAIT): ``posix_fadvise(WILLNEED)`` per run, same window, then ``preadv``.
- ``pool`` (macOS and anywhere else): a reused pool of threads, each reading one offset-sorted chunk of the runs
  with blocking reads, so ``threads`` reads are in flight and no Python task is made per row.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from clusterctl.ple.errors import TruncatedTensorFile

MODES = ("nowait", "fadvise", "pool")
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
MAX_GAP = 8192  # coalesce rows this close: one request instead of two costs less than the extra bytes
MAX_RUN_BYTES = 4 << 20
DEFAULT_WINDOW = 128  # runs in flight: deep enough for NVMe/virtio queues, below the block layer's 256 tags
DEFAULT_THREADS = 64
PROBE_SAMPLE = 32  # probes before deciding a call is mostly cold (< 1/4 cached): then WILLNEED, no failing calls

_HAS_NOWAIT = hasattr(os, "RWF_NOWAIT") and hasattr(os, "preadv")
_HAS_FADVISE = hasattr(os, "posix_fadvise")


def default_mode() -> str:
    env = os.environ.get("CLUSTERCTL_PLE_IO", "").strip().lower()
    if env and env != "auto":
        return check_mode(env)
    if sys.platform.startswith("linux") and _HAS_NOWAIT:
        return "nowait"
    if _HAS_FADVISE and hasattr(os, "preadv"):
        return "fadvise"
    return "pool"


def check_mode(mode: str) -> str:
    if mode == "auto":
        return default_mode()
    if mode not in MODES:
        raise ValueError(f"unknown PLE io mode {mode!r} (choose auto, {', '.join(MODES)})")
    if mode == "nowait" and not _HAS_NOWAIT:
        raise ValueError("io mode 'nowait' needs os.preadv and os.RWF_NOWAIT (Linux)")
    if mode == "fadvise" and not (_HAS_FADVISE and hasattr(os, "preadv")):
        raise ValueError("io mode 'fadvise' needs os.posix_fadvise and os.preadv")
    return mode


class Run:
    """One read: ``total`` contiguous file bytes at ``off`` scattered over ``iov`` (row slots and gap scratch)."""

    __slots__ = ("fd", "off", "iov", "total", "path")

    def __init__(self, fd: int, off: int, iov: list, total: int, path: str):
        self.fd, self.off, self.iov, self.total, self.path = fd, off, iov, total, path


def build_runs(runs: list, fd: int, path: str, offs, rb: int, slots, flat: memoryview, scratch: memoryview) -> None:
    """Append the runs reading rows at sorted unique file offsets ``offs`` into row ``slots`` of ``flat``."""
    cur = None
    end = 0
    for o, s in zip(offs.tolist(), slots.tolist()):
        dst = flat[s * rb:(s + 1) * rb]
        gap = o - end
        if cur is not None and gap <= MAX_GAP and len(cur.iov) < IOV_MAX - 1 and cur.total < MAX_RUN_BYTES:
            if gap:
                cur.iov.append(scratch[:gap])
            cur.iov.append(dst)
            cur.total += gap + rb
        else:
            cur = Run(fd, o, [dst], rb, path)
            runs.append(cur)
        end = o + rb


def _rest(iov: list, done: int) -> list:
    if not done:
        return iov
    for i, b in enumerate(iov):
        n = len(b)
        if done < n:
            return [b[done:]] + iov[i + 1:]
        done -= n
    return []


def finish(run: Run, done: int = 0) -> None:
    """Complete a run with blocking reads: loop over short reads; end-of-file inside a tensor is an error."""
    while done < run.total:
        try:
            n = os.preadv(run.fd, _rest(run.iov, done), run.off + done)
        except InterruptedError:  # PEP 475 retries already; kept for handlers that raise it themselves
            continue
        if n == 0:
            raise TruncatedTensorFile(f"{run.path}: end of file at byte {run.off + done} inside a tensor "
                                      "(file truncated while open?)")
        done += n


def _nowait(runs: list, window: int, stats: dict) -> None:
    """Probe each run with RWF_NOWAIT (copy if cached, else start its read); once PROBE_SAMPLE probes show the call
    is mostly cold, advise the rest with WILLNEED instead (no failed call per run). Up to ``window`` in flight."""
    pend: deque = deque()
    flag = os.RWF_NOWAIT
    advise = os.posix_fadvise if _HAS_FADVISE else None
    probing = True
    probed = hits = 0
    for run in runs:
        if probing:
            try:
                n = os.preadv(run.fd, run.iov, run.off, flag)
            except BlockingIOError:
                n = -1
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                stats["nowait_refused"] = True
                probing = False
                n = None
            if n is not None:
                probed += 1
                if n == run.total:
                    hits += 1
                    continue
                if n == 0:
                    raise TruncatedTensorFile(f"{run.path}: end of file at byte {run.off} inside a tensor "
                                              "(file truncated while open?)")
                if n > 0:  # partly cached (a real short read): make sure the rest is on its way too
                    stats["partial"] += 1
                    if advise:
                        advise(run.fd, run.off + n, run.total - n, os.POSIX_FADV_WILLNEED)
                pend.append((run, max(n, 0)))
                if probed == PROBE_SAMPLE and hits * 4 < probed:
                    probing = False
                if len(pend) >= window:
                    finish(*pend.popleft())
                continue
        if advise:
            advise(run.fd, run.off, run.total, os.POSIX_FADV_WILLNEED)
        pend.append((run, 0))
        if len(pend) >= window:
            finish(*pend.popleft())
    stats["hits"] += hits
    stats["misses"] += len(runs) - hits
    while pend:
        finish(*pend.popleft())


def _fadvise(runs: list, window: int, stats: dict) -> None:
    pend: deque = deque()
    advise = os.posix_fadvise
    need = os.POSIX_FADV_WILLNEED
    for run in runs:
        advise(run.fd, run.off, run.total, need)
        pend.append(run)
        if len(pend) >= window:
            finish(pend.popleft())
    while pend:
        finish(pend.popleft())
    stats["misses"] += len(runs)


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # the parent's worker threads do not exist in the child: start a fresh pool on first use
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _get_pool(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < threads:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ple-read")
            _pool_size = threads
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _read_group(group: list) -> None:
    for run in group:
        finish(run, 0)


def _pool_read(runs: list, threads: int, stats: dict) -> None:
    stats["misses"] += len(runs)
    k = min(threads, len(runs))
    if k <= 1:
        _read_group(runs)
        return
    n = len(runs)
    groups = [runs[i * n // k:(i + 1) * n // k] for i in range(k)]
    futs = [_get_pool(threads).submit(_read_group, g) for g in groups]
    err = None
    for f in futs:  # wait for every worker before returning: they write into the caller's buffer
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below after all workers are done
            err = err or e
    if err is not None:
        raise err


def read_runs(runs: list, mode: str, *, window: int = DEFAULT_WINDOW, threads: int = DEFAULT_THREADS) -> dict:
    """Read every run completely into its buffers. Returns counts of runs: found cached by the probe (hits),
    not (misses), partly (partial)."""
    stats = {"hits": 0, "misses": 0, "partial": 0, "nowait_refused": False}
    if not runs:
        return stats
    runs.sort(key=lambda r: (r.fd, r.off))
    if mode == "nowait":
        _nowait(runs, window, stats)
    elif mode == "fadvise":
        _fadvise(runs, window, stats)
    else:
        _pool_read(runs, threads, stats)
    return stats
