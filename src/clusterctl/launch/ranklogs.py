"""A failed launch explains itself: every rank's log is kept under ``<state>/reports/<job>/`` before the
teardown removes the node files, and the failing rank's last lines go into the error.

Where a rank's output lives: a detached rank writes ``<job>-rank<r>.log`` in its node's runtime dir (read here
through the node's transport, the last ``KEEP_BYTES`` of it); a foreground rank writes to its keeper's channel,
of which the coordinator keeps the last 64 KiB (transport.StartedProcess). A node that cannot be reached is noted
in the index (``ranks.json``) and the error, never fatal: the launch error is what matters.
"""

from __future__ import annotations

import asyncio
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import ClusterctlError, LaunchFailed
from clusterctl.atomic import atomic_write_bytes, atomic_write_json
from clusterctl.connect.transport import TAIL_BYTES
from clusterctl.protocol import runtimefiles as rf

KEEP_BYTES = 4 << 20  # the last 4 MiB of each rank's log
TAIL_LINES = 20  # of the failing rank, in --json (the error line carries the last one)
LINE_CHARS = 500
READ_TIMEOUT = 60.0

def printable(text: str, limit: int = LINE_CHARS) -> str:
    """One line of untrusted output (a rank's log) made safe for a terminal and a one-line error: control and
    format characters (ANSI escapes, carriage returns, bidi overrides) shown as escapes, trailing blanks
    dropped (the indentation of a traceback kept), cut to ``limit``."""
    out = []
    for ch in text:
        if ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    s = "".join(out).rstrip()
    return s if len(s) <= limit else s[:limit] + "…"


def last_lines(data: bytes, n: int = TAIL_LINES) -> list[str]:
    """The last ``n`` non-empty lines of a log, each made printable."""
    lines = [ln for ln in data[-(n * 4096):].decode("utf-8", "replace").splitlines() if ln.strip()]
    return [printable(ln) for ln in lines[-n:]]


@dataclass
class KeptLog:
    rank: int
    node: str
    file: str | None = None  # where it was kept; None when it could not be read
    bytes: int = 0
    truncated: bool = False  # only the last KEEP_BYTES (a detached rank) or 64 KiB (a foreground one)
    source: str = ""  # the node's log path, or "keeper channel"
    error: str | None = None
    tail: list[str] = field(default_factory=list)  # for the operator only: no decision reads these words
    ended: rf.EndReason | None = None  # the typed reason its marker gives for its end (None: none, or no marker)
    followed: bool = False  # its marker says it only followed a lost ring peer

    def to_json(self) -> dict:
        return {"rank": self.rank, "node": self.node, "file": self.file, "bytes": self.bytes,
                "truncated": self.truncated, "source": self.source, "error": self.error}


@dataclass
class KeptLogs:
    folder: Path
    ranks: list[KeptLog]
    failing: int | None = None  # the rank whose last lines explain the failure

    def of(self, rank: int | None) -> KeptLog | None:
        return next((k for k in self.ranks if k.rank == rank), None)

    def to_json(self) -> dict:
        f = self.of(self.failing)
        return {"folder": str(self.folder), "failing_rank": self.failing,
                "failing_tail": f.tail if f else [], "ranks": [k.to_json() for k in self.ranks]}


async def _read_node_log(h, path: str) -> tuple[int, bytes]:
    """(size, last KEEP_BYTES) of a log on a node: its node op ``tail`` (never through a symlink or a FIFO)."""
    return await h.read_tail(path, KEEP_BYTES, timeout=READ_TIMEOUT)


async def _read_end(run, rec, k: KeptLog) -> None:
    """The rank's marker's word on how it ended, into ``k`` (left unset when the marker is missing or unreadable)."""
    h = run.hs.get(rec.node)
    if h is None or not rec.marker_path:
        return
    try:
        mk = rf.parse_marker(await h.read_json(rec.marker_path))
    except (ClusterctlError, OSError, TimeoutError):
        return
    if mk is not None:
        k.ended, k.followed = mk.reason, rf.followed_a_peer(mk.state, mk.reason)


async def _collect(run, r) -> tuple[KeptLog, bytes]:
    rec = run.manifest.ranks[r.rank]
    k = KeptLog(rank=r.rank, node=r.node)
    if rec.pid:
        await _read_end(run, rec, k)
    p = run.procs.get(r.rank)
    if p is not None:
        err, out = p.stderr_tail, p.stdout_tail
        data = err + (b"\n--- stdout ---\n" + out if out.strip() else b"")
        k.source, k.truncated = "keeper channel", len(err) >= TAIL_BYTES or len(out) >= TAIL_BYTES
        return k, data
    if not rec.pid:
        k.error = "never started"
        return k, b""
    if not rec.log_path:
        k.error = "no log file"
        return k, b""
    k.source = rec.log_path
    try:
        size, data = await _read_node_log(run.hs[r.node], rec.log_path)
    except (ClusterctlError, OSError, ValueError, TimeoutError) as e:
        k.error = printable(getattr(e, "message", None) or str(e) or type(e).__name__)
        return k, b""
    k.truncated = size > len(data)
    return k, data


async def keep_logs(run, folder: Path) -> KeptLogs:
    """Copy every started rank's log of ``run`` into ``folder`` (``rank<r>.log``, atomically, 0600) and write
    the index ``ranks.json``. Per-rank problems are noted, never raised."""

    ranks = sorted(run.manifest.ranks, key=lambda r: r.rank)
    got = await asyncio.gather(*(_collect(run, r) for r in ranks), return_exceptions=True)
    kept = []
    for r, g in zip(ranks, got):
        if isinstance(g, BaseException):
            kept.append(KeptLog(rank=r.rank, node=r.node, error=printable(str(g) or type(g).__name__)))
            continue
        k, data = g
        if k.error is None:
            try:
                path = folder / f"rank{r.rank}.log"
                await asyncio.to_thread(atomic_write_bytes, path, data, mode=0o600)
                k.file, k.bytes, k.tail = str(path), len(data), last_lines(data)
            except (OSError, ClusterctlError) as e:
                k.error = f"cannot write {folder}: {getattr(e, 'message', None) or e}"
        kept.append(k)
    logs = KeptLogs(folder=folder, ranks=kept)
    try:
        await asyncio.to_thread(atomic_write_json, folder / "ranks.json", {"ranks": [k.to_json() for k in kept]})
    except (OSError, ClusterctlError):
        pass  # the logs themselves are what matters
    return logs


def failing_rank(error: BaseException, run, gone: dict[int, bool]) -> int | None:
    """The rank whose log explains ``error``: the one the error names, else the first whose process was gone
    when the launch failed (one that failed on its own before one that only followed a lost peer: ``gone``
    maps rank -> followed), else rank 0 (it answered the canary and waits for every other rank)."""
    named = [x.get("rank") for x in getattr(error, "ranks", None) or [] if isinstance(x, dict)]
    if named and isinstance(named[0], int):
        return named[0]
    if gone:
        return min(gone, key=lambda r: (gone[r], r))
    return 0 if run.manifest.ranks else None


OWN_FAILURE = frozenset({rf.EndReason.FAILED, rf.EndReason.INTERNAL})  # an error of its own, or a crash


def with_own_failure(chosen: int | None, logs: "KeptLogs") -> int | None:
    """``chosen``, unless its marker says it only followed a lost peer and another rank's marker says it ended on
    an error of its own: that one explains the launch's failure (the coordinator may have seen the follower gone
    first). Decided on the markers' typed reasons; the logs' words are only shown."""
    k = logs.of(chosen)
    if k is None or not k.followed:
        return chosen
    own = [o.rank for o in logs.ranks if o.ended in OWN_FAILURE]
    return own[0] if own else chosen


class LaunchFailedWithLogs(LaunchFailed):
    """A LaunchFailed whose ranks' logs were kept: its JSON names the folder, each file and the failing rank's
    last lines (``logs``); ``kind`` stays ``LaunchFailed``."""

    def __init__(self, e: LaunchFailed, logs: KeptLogs):
        super().__init__(e.message, ranks=e.ranks, teardown=e.teardown, hint=e.hint, exit_code=e.exit_code)
        self.logs = logs

    def to_json(self) -> dict:
        out = super().to_json()
        out["kind"] = "LaunchFailed"
        out["logs"] = self.logs.to_json()
        return out


def explain(e: LaunchFailed, logs: KeptLogs) -> LaunchFailedWithLogs:
    """The launch error with the failing rank's last line (unless the error already carries it) and where
    the logs are, still one line."""
    f = logs.of(logs.failing)
    msg = e.message
    if f is not None and f.tail and f.tail[-1].strip() not in msg:
        msg += f"; rank {f.rank} on {f.node} last logged: {f.tail[-1].strip()}"
    unread = [f"rank {k.rank} on {k.node}: {k.error}" for k in logs.ranks if k.error and k.error != "never started"]
    msg += f"; rank logs kept in {logs.folder}" + (f" (not kept: {'; '.join(unread)})" if unread else "")
    out = LaunchFailedWithLogs(e, logs)
    out.message = msg
    out.args = (msg,)
    return out
