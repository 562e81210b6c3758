"""The node operations on a job's markers (nodeops.py serves them): read them (``markers``), wait until they reach
a state (``wait_markers``), and the one look at them both the node's long poll and a local node's in-process wait
take (``look_at_markers``). A marker is read only when this user owns it, tolerantly: a missing, truncated or
foreign one is None, never an error.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from clusterctl.atomic import read_json
from clusterctl.errors import ClusterctlError
from clusterctl.protocol.nodeops import (Exited, MarkerEntry, MarkersAnswer, MarkersRequest, WaitMarkersAnswer,
                                        WaitMarkersRequest, WatchedRank)
from clusterctl.protocol.runtimefiles import MARKER_LIMIT, marker_rank
from clusterctl.node.procs import status_of


def read_own_json(path: Path) -> dict | None:
    """A small JSON object this user owns (a marker, a cancel file), or None."""
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid():
            return None  # another user's file: never act on it
        doc = read_json(path, limit=MARKER_LIMIT, what="marker")
        return doc if isinstance(doc, dict) else None
    except (ClusterctlError, OSError):
        return None


def job_markers(runtime_dir: str, job_id: str) -> list[tuple[Path, dict | None]]:
    folder = Path(runtime_dir)
    out = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for n in names:
        if marker_rank(n, job_id) is not None:
            p = folder / n
            out.append((p, read_own_json(p)))
    return out


def op_markers(req: MarkersRequest) -> MarkersAnswer:
    now = time.time()
    out = []
    for p, doc in job_markers(req.runtime_dir, req.job_id):
        if doc is None:
            out.append(MarkerEntry(path=str(p), error="unreadable or foreign marker"))
            continue
        st = os.stat(p)
        # Ages on this node's own clock: the file's mtime against this node's now.
        out.append(MarkerEntry(path=str(p), marker=doc, age=max(0.0, now - st.st_mtime)))
    return MarkersAnswer(markers=out, time=now)


MARKER_WAIT_POLL = 0.02
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 16384


def op_wait_markers(req: WaitMarkersRequest) -> WaitMarkersAnswer:
    """Wait (up to ``timeout`` s) until every marker in ``paths`` is in one of ``states``, one failed, or a
    watched rank's process is gone (``watch``, see look_at_markers); return them all as they are then. The
    coordinator long-polls with this instead of reading each marker every poll."""
    states = set(req.states)
    deadline = time.monotonic() + min(req.timeout, 30.0)
    while True:
        look, settled = look_at_markers(req.paths, states, req.watch)
        if settled or time.monotonic() >= deadline:
            return look
        time.sleep(MARKER_WAIT_POLL)


def look_at_markers(paths: list[str], states: set[str],
                    watch: list[WatchedRank | None] | None = None) -> tuple[WaitMarkersAnswer, bool]:
    """One look at the markers at ``paths``: the answer (``markers``, each a dict or None, and ``exited``) and
    whether it is settled (every marker in ``states``, one failed, or a watched rank gone).

    ``watch`` (one entry per path, or None) names a detached rank's process (pid, start_time, nonce, boot_id) and
    its ``log_path``. Nobody waits on a detached rank's exit, so a rank that dies at start would otherwise keep
    its launch waiting for the whole timeout: a watched process that is gone (identity-checked, a zombie counts
    as gone) while its marker is short of ``states`` gets the last lines of its log in ``exited``."""

    watch = list(watch or []) + [None] * (len(paths) - len(watch or []))
    # the processes first, their markers after: a rank that wrote its last marker and exited is judged by it
    gone = [w is not None and status_of(w) in ("dead", "foreign") for w in watch[:len(paths)]]
    docs = [read_own_json(Path(p)) for p in paths]
    exited = [Exited(log_tail=_log_tail(w.log_path)) if g and (d or {}).get("state") not in states else None
              for g, w, d in zip(gone, watch, docs)]
    return (WaitMarkersAnswer(markers=docs, exited=exited),
            markers_settled(docs, states) or any(e is not None for e in exited))


def _log_tail(path: str | None) -> list[str]:
    """The last LOG_TAIL_LINES non-empty lines of a rank's log (nothing when it cannot be read)."""
    if not path:
        return []
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the wait
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - LOG_TAIL_BYTES), os.SEEK_SET)
        data = os.read(fd, LOG_TAIL_BYTES)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return [ln[:1000] for ln in lines[-LOG_TAIL_LINES:]]


def markers_settled(docs: list[dict | None], states: set[str]) -> bool:
    """Every marker is in one of ``states``, or one has failed (waiting longer would not help)."""
    got = [(d or {}).get("state") for d in docs]
    return all(g in states for g in got) or "failed" in got
