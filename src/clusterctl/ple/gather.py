"""One gather call over any number of tensors and shards: warm rows from memory, the rest by cold reads.

Warm = every page of the row was seen resident in the shard's current generation. Those rows are copied from
the mapping with ``np.take`` (one copy, no syscall per row), in chunks of 16, 256 and 4096 rows; between
chunks the thread's major-fault counter is read. A major fault means the page cache lost a page we trusted (the
fault reads it back). A few are taken as they come; a large eviction (>= 8 faults and > 2% of the pages touched)
makes the shard forget what it saw and sends the rest of the call down the cold path, which probes with
RWF_NOWAIT and so copies what is still cached instead of re-reading it. Either way it is a recovery, logged with
its counts. Minor faults (cached but not yet mapped) do not count, so they never cause re-reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clusterctl.ple.coldio import MAX_GAP, build_runs, read_runs
from clusterctl.ple.residency import PAGE, major_faults
from clusterctl.ple.safetensors import TensorEntry
from clusterctl.ple.shard import ShardFile

FIRST_CHUNK = 16
MAX_CHUNK = 4096
# a missed page costs one serial fault (~75 us) on the warm path; re-checking a row on the cold path ~2 us:
# past ~2% of the pages evicted the cold path is cheaper for the rest of the call
SWITCH_FAULTS = 8
SWITCH_FRACTION = 0.02


@dataclass(slots=True)
class Part:
    """Rows ``idx`` of one tensor, going to rows ``pos`` of ``out2d`` (pos None: to rows 0..len(idx)-1)."""

    shard: ShardFile
    entry: TensorEntry
    idx: np.ndarray
    out2d: np.ndarray  # uint8 (N, row_bytes) view of the caller's output
    pos: np.ndarray | None


def _warm(src: np.ndarray, idx: np.ndarray, out2d: np.ndarray, pos: np.ndarray | None,
          pages_per_row: int) -> tuple[int, int, bool]:
    """Copy rows from the mapping, watching the thread's major faults: (rows done, faults, switched).

    Each major fault is a trusted page the kernel had evicted; the fault itself brings it back. A few are cheaper
    to take here than re-checking every row, so the gather goes on; once they reach SWITCH_FAULTS and more than
    SWITCH_FRACTION of the pages touched, the eviction is large: stop, and let the cold path do the rest."""
    n = len(idx)
    a = 0
    step = FIRST_CHUNK
    faults = 0
    f0 = major_faults()
    while a < n:
        b = min(n, a + step)
        if pos is None:
            # mode="clip": indices are already checked, and "raise" would buffer the output (a second copy)
            src.take(idx[a:b], axis=0, out=out2d[a:b], mode="clip")
        else:
            out2d[pos[a:b]] = src[idx[a:b]]
        f1 = major_faults()
        if f1 != f0:
            faults += f1 - f0
            f0 = f1
            if faults >= SWITCH_FAULTS and faults > SWITCH_FRACTION * b * pages_per_row:
                return b, faults, True
        a = b
        step = min(step * 16, MAX_CHUNK)
    return n, faults, False


def gather(parts: list[Part], *, mode: str, window: int, threads: int, on_recovery) -> dict:
    """Fill every part's output rows. ``on_recovery(shard, faults, switched)`` is called when trusted pages were
    missing (switched: so many that the rest of the part went the cold way)."""
    counts = {"warm_rows": 0, "cold_rows": 0, "runs": 0, "hits": 0, "partial": 0, "cold_bytes": 0,
              "nowait_refused": False}
    for p in parts:  # before any I/O: a shrunk file must give an error, not a SIGBUS in the mapped copy
        p.shard.check_unchanged()
    cold: list[tuple[Part, np.ndarray, np.ndarray]] = []
    for p in parts:
        n = len(p.idx)
        rb = p.entry.row_bytes
        offs = p.idx * rb
        offs += p.entry.start
        if p.shard.all_seen(offs, rb):
            seen = None
            sel, widx, wpos = None, p.idx, p.pos
        else:
            seen = p.shard.seen(offs, rb)
            if not seen.any():
                cold.append((p, p.idx, np.arange(n) if p.pos is None else p.pos))
                continue
            sel = np.flatnonzero(seen)
            widx = p.idx[sel]
            wpos = sel if p.pos is None else p.pos[sel]
        done, faults, switched = _warm(p.shard.view(p.entry), widx, p.out2d, wpos, (rb + PAGE - 1) // PAGE + 1)
        counts["warm_rows"] += done
        if faults:
            on_recovery(p.shard, faults, switched)
        if sel is None:
            if done == n:
                continue
            rest = np.arange(done, n)
        else:
            rest = np.flatnonzero(~seen)
            if done < len(widx):
                rest = np.concatenate([rest, sel[done:]])
        cold.append((p, p.idx[rest], rest if p.pos is None else p.pos[rest]))
    if cold:
        _cold(cold, counts, mode=mode, window=window, threads=threads)
    return counts


def _cold(cold: list, counts: dict, *, mode: str, window: int, threads: int) -> None:
    runs: list = []
    dups = []
    marks = []
    flats: dict[int, memoryview] = {}
    scratch = memoryview(bytearray(MAX_GAP))
    for p, idx, pos in cold:
        rb = p.entry.row_bytes
        u, first, inv = np.unique(idx, return_index=True, return_inverse=True)
        offs = p.entry.start + u * rb
        flat = flats.get(id(p.out2d))
        if flat is None:
            flat = flats[id(p.out2d)] = memoryview(p.out2d.reshape(-1))
        build_runs(runs, p.shard.fd, p.shard.path, offs, rb, pos[first], flat, scratch)
        if len(u) < len(idx):
            src = first[inv.reshape(-1)]
            d = np.flatnonzero(src != np.arange(len(idx)))
            dups.append((p.out2d, pos[d], pos[src[d]]))
        marks.append((p.shard, offs, rb))
        counts["cold_rows"] += len(u)
    st = read_runs(runs, mode, window=window, threads=threads)
    counts["runs"] += len(runs)
    counts["hits"] += st["hits"]
    counts["partial"] += st["partial"]
    counts["nowait_refused"] = st["nowait_refused"]
    counts["cold_bytes"] += sum(r.total for r in runs)
    for out2d, dst, src in dups:
        out2d[dst] = out2d[src]
    for shard, offs, rb in marks:
        shard.mark_seen(offs, rb)
