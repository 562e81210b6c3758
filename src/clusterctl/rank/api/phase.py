"""Rank 0's serving phase: one value the main thread, the signal handler, the HTTP threads and the step loop all
write and read, behind a lock, moving one way only (issue 43: it was a bare string written from four threads, and
``serving()`` could overwrite a stop that had just come in, which a re-check then patched back).

    loading -> ready -> serving -> stopping        failed from any phase
    loading, ready ------------->  stopping

(ready: the layers are loaded and the rank waits for the launcher's gate)

A stop or a failure is never undone: ``serving()`` after a stop leaves the rank stopping, a stop after a failure
leaves it failed. What clients see: /health's status and the 503 of a request that arrives while not serving."""

from __future__ import annotations

import enum
import threading


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    SERVING = "serving"
    STOPPING = "stopping"
    FAILED = "failed"


_NEXT = {Phase.LOADING: {Phase.READY, Phase.SERVING, Phase.STOPPING, Phase.FAILED},
         Phase.READY: {Phase.SERVING, Phase.STOPPING, Phase.FAILED},
         Phase.SERVING: {Phase.STOPPING, Phase.FAILED},
         Phase.STOPPING: {Phase.FAILED},
         Phase.FAILED: set()}


class ServingPhase:
    def __init__(self) -> None:
        self._now = Phase.LOADING
        self._lock = threading.Lock()

    @property
    def now(self) -> Phase:
        return self._now

    @property
    def serving(self) -> bool:
        return self._now is Phase.SERVING

    def to(self, phase: Phase) -> bool:
        """Move to ``phase`` if it comes after the current one; returns whether it did (False: already there, or
        past it)."""
        with self._lock:
            if phase not in _NEXT[self._now]:
                return False
            self._now = phase
            return True
