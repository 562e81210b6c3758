"""When the ranks meet: every CHECKPOINT_S of decoding while busy (``Cadence``), on a shared idle schedule when not
(``idle_interval``), sooner when a rank calls the others to a meeting (``IdleWait``). Pure of MLX: every rank
derives the same schedule from the same meeting count (docs/rank.md, "Step loop and sharing")."""

from __future__ import annotations

import threading
import time
from typing import Callable

CHECKPOINT_S = 0.25  # decoding time between meetings: cancel/stop/join latency vs one pipeline drain each
FIRST_CHECKPOINT = 4  # steps before the first meeting of a busy batch (the rate is not known yet)
MAX_CHECKPOINT = 64


class Cadence:
    """Rank 0: steps until the next meeting, so meetings come about every ``target`` seconds at any speed
    (at 80 steps/s every 20 steps, at 4 steps/s every step). A meeting drains the step in flight: on the 7M
    model's 2 ranks, meeting every 0.1 s cost ~5% of one stream's tok/s against every 64 steps (66.0 vs 69.8
    tok/s, medians of 3), so 0.25 s (~2%)."""

    def __init__(self, target: float = CHECKPOINT_S, clock: Callable[[], float] = time.monotonic):
        self.target, self.clock = target, clock
        self.t = clock()

    def next_gap(self, tokens: int) -> int:
        """``tokens`` were decoded since the last call (or since the cadence was made)."""
        now = self.clock()
        dt, self.t = now - self.t, now
        if dt <= 0:
            return MAX_CHECKPOINT
        return max(1, min(MAX_CHECKPOINT, int(self.target * tokens / dt)))


# idle meetings when ranks call each other to meetings: work brings a meeting at once, so the schedule is only a
# safety net. Every idle meeting costs a few ms of a core per rank (a rank that arrives first spins in the
# collective until the others come): at 0.5 s that was 1-2 % of a core per idle rank, at 10 s it is noise.
IDLE_WAKEABLE_S = 10.0
CALL_AGAIN_S = 0.1  # a call not answered by the meeting yet is sent again this often (a datagram may be lost)


def idle_interval(ticks_since_request: int, wakeable: bool = False) -> float:
    """Seconds between idle meetings; a pure function of the shared tick count (and of the contract, which says
    whether ranks can wake each other) so all ranks agree."""
    if wakeable:
        return IDLE_WAKEABLE_S
    if ticks_since_request < 10:
        return 0.02  # a client's follow-up request usually comes right away
    if ticks_since_request < 100:
        return 0.05
    return 0.1


class IdleWait:
    """How an idle rank waits for the next meeting: its scheduled time, or sooner.

    Sooner when this rank has work for the ranks (``local``: rank 0 got a request, a stop was asked): it then
    calls the other ranks to the meeting (``call(seq)``) so that nobody spins in the collective waiting for
    them. Or sooner when another rank called this one to the meeting it is about to hold (``called``); a call
    for a meeting already held is stale and ignored. Without ``call`` (no wake-up calls) a local event does not
    shorten the wait: the others would come only at their scheduled time anyway.

    ``check`` (rank 0: has the cancel file changed?) is asked every CHECK_S while waiting, for the first
    CHECK_FAST_FOR_S of an idle spell (a cancel often comes right after a request), then every CHECK_IDLE_S (20
    looks a second were a third of an idle deployment's CPU); yes counts as local work, so a cancel sent to an
    idle deployment is applied and acked within a look, not at the next scheduled meeting.

    A call is a datagram: one that is lost would leave the caller spinning in the meeting's collective until the
    others' scheduled time (or its exchange deadline). So a call is sent again every CALL_AGAIN_S until the step
    loop says the meeting was held (``met``), from a thread of its own (the caller's main thread is in the
    collective by then)."""

    CHECK_S = 0.05
    CHECK_FAST_FOR_S = 5.0
    CHECK_IDLE_S = 0.25

    def __init__(self, call: Callable[[int], None] | None = None, check: Callable[[], bool] | None = None):
        self._call = call
        self._check = check
        self._cv = threading.Condition()
        self._local = False
        self._called = -1  # the newest meeting another rank called this one to
        self._calling: int | None = None  # the meeting this rank called the others to, not held yet
        self._again: threading.Thread | None = None
        self.sent = self.heard = 0  # calls made to the others; waits a call from another rank ended

    @property
    def can_call(self) -> bool:
        return self._call is not None

    def local(self) -> None:
        if self._call is None:
            return
        with self._cv:
            self._local = True
            self._cv.notify_all()

    def called(self, seq: int) -> None:
        with self._cv:
            if seq > self._called:
                self._called = seq
                self._cv.notify_all()

    def wait(self, timeout: float, seq: int, *, idle_for: float = 0.0) -> None:
        """Sleep up to ``timeout`` before meeting ``seq``; ``idle_for``: how long the ranks have been idle already."""
        if self._call is None:
            time.sleep(timeout)
            return
        start = time.monotonic()
        deadline = start + timeout
        with self._cv:
            while not (early := self._local or self._called >= seq):
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    break
                look = self.CHECK_S if idle_for + now - start < self.CHECK_FAST_FOR_S else self.CHECK_IDLE_S
                self._cv.wait(min(left, look) if self._check is not None else left)
                if self._check is not None and self._check():
                    self._local = True
            call, self._local = self._local, False
            if early and not call:
                self.heard += 1
        if call:
            self.sent += 1
            self._call(seq)
            self._call_again(seq)

    def met(self, seq: int) -> None:
        """Meeting ``seq`` was held: no more calls to it."""
        with self._cv:
            if self._calling is not None and self._calling <= seq:
                self._calling = None
                self._cv.notify_all()

    def _call_again(self, seq: int) -> None:
        with self._cv:
            self._calling = seq
            if self._again is None:
                self._again = threading.Thread(target=self._again_loop, name="wake-again", daemon=True)
                self._again.start()

    def _again_loop(self) -> None:
        while True:
            with self._cv:
                while self._calling is None:
                    self._cv.wait()
                seq = self._calling
                self._cv.wait(CALL_AGAIN_S)
                if self._calling != seq:
                    continue
            self._call(seq)
