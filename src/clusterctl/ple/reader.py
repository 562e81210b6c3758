"""The PLE reader: rows of huge tables gathered from safetensors files on SSD, at the device's speed.

    with Reader("/models/m") as r:                 # a file, a folder, or a model.safetensors.index.json
        t = r.table("model.ple.weight")            # or r.table([...]) for one table split over tensors
        x = t.rows(ids)                            # == tensor[ids], storage dtype, C-contiguous
        q = r.quantized_table("model.embed_tokens").rows(ids)     # (weight u32, scales, biases)
        d = r.gather_many({"layers.0.ple": ids, "layers.1.ple": ids})  # one batched cold pass

Thread-safe; close() may come while gathers run (they finish, the files close after the last one); after a fork
the child gets fresh locks and a fresh read pool and keeps the inherited descriptors and mappings.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from clusterctl.ple import coldio
from clusterctl.ple.errors import ReaderClosed, TensorNotFound
from clusterctl.ple.gather import gather
from clusterctl.ple.safetensors import INDEX_NAME, TensorEntry, read_index
from clusterctl.ple.shard import ShardFile
from clusterctl.ple.table import QuantizedRows, QuantizedTable, Table, as_indices

log = logging.getLogger("clusterctl.ple")

LOG_EVERY_S = 60.0  # after the first recovery line per file, at most one summary line a minute

_live: weakref.WeakSet = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for r in list(_live):
        r._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


class Reader:
    """Serves rows of the tensors of one safetensors file, a folder, or a sharded checkpoint.

    ``io``: ``auto`` (default; env CLUSTERCTL_PLE_IO overrides), ``nowait``, ``fadvise`` or ``pool``.
    ``window``: cold reads in flight (nowait/fadvise); ``threads``: pool size (pool).
    """

    def __init__(self, path: str | os.PathLike, *, io: str = "auto", window: int = coldio.DEFAULT_WINDOW,
                 threads: int = coldio.DEFAULT_THREADS):
        self.io = coldio.check_mode(io)
        if window < 1 or threads < 1:
            raise ValueError("window and threads must be >= 1")
        self.window, self.threads = window, threads
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._active = 0
        self._closed = False
        self._released = False
        self._shards: dict[str, ShardFile] = {}
        self._tables: dict[str, Table | QuantizedTable] = {}  # same names -> same object (usable as keys)
        self._stats = dict.fromkeys(("calls", "warm_rows", "cold_rows", "runs", "hits", "partial", "cold_bytes",
                                     "recoveries", "recovery_faults"), 0)
        self._log_state: dict[str, list] = {}
        p = Path(path)
        if p.is_dir():
            self.folder = p
            if (p / INDEX_NAME).is_file():
                self._map = read_index(p / INDEX_NAME)
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise TensorNotFound(f"no safetensors files in {p}")
                self._map = self._map_from_headers(files)
        elif p.name.endswith(".index.json"):
            self.folder = p.parent
            self._map = read_index(p)
        elif p.is_file():
            self.folder = p.parent
            self._map = self._map_from_headers([p])
        else:
            raise TensorNotFound(f"no safetensors file or folder at {p}")
        _live.add(self)

    def _map_from_headers(self, files: list[Path]) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in files:
            for name in self._open_shard(f.name).entries:
                out.setdefault(name, f.name)
        return out

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._active = 0  # threads that were gathering in the parent do not exist here
        for s in self._shards.values():
            s.after_fork()

    def _enter(self) -> None:
        if os.getpid() != self._pid:
            self._after_fork()
        with self._lock:
            if self._closed:
                raise ReaderClosed(f"PLE reader of {self.folder} is closed")
            self._active += 1

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            release = self._closed and self._active == 0 and not self._released
            if release:
                self._released = True
        if release:
            self._release()

    def close(self) -> None:
        """Close the files. Gathers already running finish first (the last one closes the files)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            release = self._active == 0 and not self._released
            if release:
                self._released = True
        if release:
            self._release()

    def _release(self) -> None:
        for s in self._shards.values():
            s.close()
        self._tables.clear()
        _live.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors ------------------------------------------------------------------------------------------------
    def _open_shard(self, fname: str) -> ShardFile:
        s = self._shards.get(fname)
        if s is None:
            with self._lock:
                s = self._shards.get(fname)
                if s is None:
                    s = self._shards[fname] = ShardFile(str(self.folder / fname))
        return s

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint (from the index, or the headers)."""
        self._check_open()
        return sorted(self._map)

    def _check_open(self) -> None:
        if self._closed:
            raise ReaderClosed(f"PLE reader of {self.folder} is closed")

    def _locate(self, name: str) -> tuple[ShardFile, TensorEntry]:
        self._check_open()
        fname = self._map.get(name)
        if fname is None:
            raise TensorNotFound(f"tensor {name!r} is not in {self.folder}")
        shard = self._open_shard(fname)
        e = shard.entries.get(name)
        if e is None:
            raise TensorNotFound(f"tensor {name!r} is not in {shard.path} (the index says it is)")
        return shard, e

    def info(self, name: str) -> TensorEntry:
        return self._locate(name)[1]

    def table(self, names: str | list[str] | tuple[str, ...]) -> Table:
        """A table of one tensor, or of several tensors stacked by rows in the order given."""
        key = names if isinstance(names, str) else "\0".join(names)
        t = self._tables.get(key)
        if t is None:
            parts = [self._locate(n) for n in ([names] if isinstance(names, str) else list(names))]
            t = self._tables[key] = Table(self, parts)
        return t

    def quantized_table(self, base: str | list[str]) -> QuantizedTable:
        """``<base>.weight`` with ``<base>.scales`` and (if present) ``<base>.biases``; base may end in .weight."""
        bases = [base] if isinstance(base, str) else list(base)
        bases = [b[: -len(".weight")] if b.endswith(".weight") else b for b in bases]
        key = "q\0" + "\0".join(bases)
        q = self._tables.get(key)
        if q is not None:
            return q
        weight = self.table([f"{b}.weight" for b in bases])
        scales = self.table([f"{b}.scales" for b in bases])
        biases = None
        if all(f"{b}.biases" in self._map for b in bases):
            biases = self.table([f"{b}.biases" for b in bases])
        q = self._tables[key] = QuantizedTable(self, weight, scales, biases)
        return q

    # -- gathers ------------------------------------------------------------------------------------------------
    def rows(self, name: str, indices, out: np.ndarray | None = None) -> np.ndarray:
        """``tensor[indices]`` for the named tensor, byte for byte (see Table.rows)."""
        return self.table(name).rows(indices, out)

    def rows_quantized(self, base: str, indices, out=None) -> QuantizedRows:
        return self.quantized_table(base).rows(indices, out)

    def gather_many(self, requests: Mapping, out: Mapping | None = None) -> dict:
        """Several tables in ONE call (one batched cold pass over all their shards), e.g. a decode step's rows
        of every layer. Keys: tensor names, Tables or QuantizedTables; values: indices. Returns key -> rows."""
        items, slices, keys = [], [], []
        for key, ind in requests.items():
            t = key if isinstance(key, (Table, QuantizedTable)) else self.table(key)
            o = out.get(key) if out is not None else None
            start = len(items)
            if isinstance(t, QuantizedTable):
                os_ = list(o) if o is not None else [None, None, None]
                items += [(tt, ind, oo) for tt, oo in zip(t.tables(), os_)]
            else:
                items.append((t, ind, o))
            slices.append((start, len(items), isinstance(t, QuantizedTable)))
            keys.append(key)
        got = self._gather_items(items)
        res = {}
        for key, (a, b, q) in zip(keys, slices):
            if q:
                g = got[a:b]
                res[key] = QuantizedRows(g[0], g[1], g[2] if len(g) > 2 else None)
            else:
                res[key] = got[a]
        return res

    def _gather_items(self, items: list) -> list[np.ndarray]:
        self._enter()
        try:
            prepared = [(t, *t._prepare(ind, o)) for t, ind, o in items]  # all checks before any I/O
            parts = []
            for t, flat, o in prepared:
                if t._reader is not self:
                    raise ValueError(f"{t!r} belongs to another reader")
                parts += t._make_parts(flat, o)
            if parts:
                c = gather(parts, mode=self.io, window=self.window, threads=self.threads,
                           on_recovery=self._recovered)
                if c["nowait_refused"]:
                    log.info("ple: %s refuses RWF_NOWAIT reads; using posix_fadvise(WILLNEED)", self.folder)
                    self.io = "fadvise"
                with self._lock:
                    s = self._stats
                    s["calls"] += 1
                    for k in ("warm_rows", "cold_rows", "runs", "hits", "partial", "cold_bytes"):
                        s[k] += c[k]
            return [o for _, _, o in prepared]
        finally:
            self._exit()

    def _recovered(self, shard: ShardFile, faults: int, switched: bool) -> None:
        if switched:
            shard.forget()
        now = time.monotonic()
        with self._lock:
            self._stats["recoveries"] += 1
            self._stats["recovery_faults"] += faults
            st = self._log_state.setdefault(shard.path, [0.0, 0, 0, True])  # last log, events, faults, first
            st[1] += 1
            st[2] += faults
            emit = st[3] or now - st[0] >= LOG_EVERY_S
            if emit:
                msg = (shard.path, st[1], st[2], st[3])
                st[:] = [now, 0, 0, False]
        if emit:
            path, events, nf, first = msg
            if first:
                log.info("ple: %s: %d major fault(s) in a warm gather: the page cache dropped pages of this file; "
                         "%s", path, nf, "re-checking residency of its rows from the page cache" if switched
                         else "they were read back")
            else:
                log.info("ple: %s: %d more residency recoveries (%d major faults) since the last message",
                         path, events, nf)

    def _residency(self, table: Table, indices) -> float:
        self._enter()
        try:
            flat, _ = as_indices(indices, table.nrows, table.name)
            res = need = 0
            for shard, e, local in table._rows_by_part(flat):
                r, n = shard.resident(e.start + np.unique(local) * e.row_bytes, e.row_bytes)
                res += r
                need += n
            return res / need if need else 1.0
        finally:
            self._exit()

    def drop_mappings(self) -> None:
        """Drop this process's page-table entries of every open shard (data stays cached; RSS goes down and the
        kernel may evict the pages). The next warm gather takes minor faults only, which cause no re-reads."""
        self._enter()
        try:
            for s in list(self._shards.values()):
                s.drop_mappings()
        finally:
            self._exit()

    def _drop_mappings(self, table: Table, indices) -> None:
        self._enter()
        try:
            flat = np.arange(table.nrows) if indices is None else as_indices(indices, table.nrows, table.name)[0]
            for shard, e, local in table._rows_by_part(flat):
                shard.drop_mappings(e.start + np.unique(local) * e.row_bytes, e.row_bytes)
        finally:
            self._exit()

    def stats(self) -> dict:
        """Counters since open: calls, warm_rows, cold_rows (unique), runs, hits (runs found cached by the
        probe), partial (runs it found partly cached), cold_bytes, recoveries, recovery_faults; and the io mode."""
        with self._lock:
            return {**self._stats, "io": self.io}


def open_reader(path: str | os.PathLike, **kw) -> Reader:
    return Reader(path, **kw)
