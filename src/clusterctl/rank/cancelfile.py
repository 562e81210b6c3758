"""Rank 0's watch of its node's cancel file (the file formats, readers and writers: runtimefiles.py).

``clusterctl cancel`` writes ``<runtime_dir>/<deployment>-cancel.json`` on every node of the job (atomically):
a new, larger epoch and the request ids to cancel (or all). Rank 0 looks at it (a stat every 0.05 s at most, a read
when it changed, from its step loop), cancels the matching requests, and sends the epoch to every rank inside the next control
collective, so all ranks apply it at the same step boundary and none leaves a collective early. Each rank then
writes ``<deployment>-rank<r>-ack.json`` with the epoch it received. An epoch already consumed is ignored (logged
once); a corrupt or foreign file (another job, another user) is logged once and ignored.

An epoch alone does not prove a cancel was applied: a coordinator that cannot read a newer file may write an epoch
rank 0 already consumed, and then the old acks carry that epoch too. So every cancel file carries a random
``nonce``, and rank 0's ack names the (epoch, nonce) it applied and its RECENT_ACKS before: a coordinator counts
rank 0 only when its own pair is there, and the other ranks only once rank 0 counts.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from clusterctl.errors import ClusterctlError
from clusterctl.protocol.runtimefiles import CancelFile, cancel_path, epoch_is_new, read_cancel
# the file formats live in runtimefiles.py; re-exported here for the rank (rank/) that imports them so
from clusterctl.protocol.runtimefiles import (EPOCH_MAX, MAX_REQUEST_IDS, NONCE_PATTERN,  # noqa: F401
                                           RECENT_ACKS, REQUEST_ID_PATTERN, CancelAck, ack_path, cancel_here,
                                           read_ack, write_ack)
from clusterctl.protocol.runtimefiles import new_cancel_nonce as new_nonce  # noqa: F401

CHECK_EVERY = 0.05  # a stat of one file (about 2 us); read only when it changed

class CancelWatch:
    """Rank 0's reader of its node's cancel file: ``poll()`` returns a cancel of this job with a new epoch. It
    looks at most every CHECK_EVERY seconds, and then only stats the file unless it changed."""

    def __init__(self, runtime_dir: str, deployment_id: str, job_id: str, *, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, every: float = CHECK_EVERY):
        self.path = cancel_path(runtime_dir, deployment_id)
        self.deployment_id, self.job_id = deployment_id, job_id
        self.log, self.clock, self.every = log, clock, every
        self.next_at = 0.0
        self.complained: set[tuple] = set()
        self.mtime: tuple | None = None
        self.consumed = 0  # a file left by an earlier job names that job: ignored as foreign, never applied
        self.consumed_nonce: str | None = None

    def _stat_key(self) -> tuple | None:
        """What tells one version of the file from another without reading it (None: no file)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self) -> CancelFile | None:
        key = self._stat_key()
        if key is None:
            return None
        if key == self.mtime:
            return None  # unchanged since the last look
        self.mtime = key
        try:
            doc = read_cancel(self.path)
        except (ClusterctlError, OSError) as e:
            self._complain(key, f"ignoring cancel file {self.path}: {getattr(e, 'message', None) or e}")
            return None
        if doc.deployment_id != self.deployment_id or doc.job_id != self.job_id:
            self._complain(("foreign", doc.job_id, doc.epoch),
                           f"ignoring cancel file {self.path}: it is for job {doc.job_id}, not {self.job_id}")
            return None
        return doc

    def _complain(self, key, msg: str) -> None:
        if key not in self.complained:
            self.complained.add(key)
            self.log(msg)

    def changed(self) -> bool:
        """Has the file changed since the last look (a stat, nothing read)? Then the next ``poll()`` reads it at
        once. What an idle rank 0 asks between its meetings, so a cancel does not wait for the idle schedule."""
        key = self._stat_key()
        if key is None or key == self.mtime:
            return False
        self.next_at = 0.0
        return True

    def poll(self) -> CancelFile | None:
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at = now + self.every
        doc = self._load()
        if doc is None:
            return None
        if not epoch_is_new(doc.epoch, self.consumed):
            # the cancel just applied, written again (nodes that share this runtime dir each get a copy): not news
            if (doc.epoch, doc.nonce) != (self.consumed, self.consumed_nonce) or doc.nonce is None:
                # said once per cancel: the rank log then explains a cancel that was never applied
                self._complain(("consumed", doc.epoch, doc.nonce),
                               f"ignoring cancel file {self.path}: epoch {doc.epoch} is not above the "
                               f"{self.consumed} already consumed")
            return None
        self.consumed, self.consumed_nonce = doc.epoch, doc.nonce
        return doc
