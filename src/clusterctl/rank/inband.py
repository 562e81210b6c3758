"""What an overlapped run asks of the step loop between meetings (overlap.py ``Hooks``): rank 0 decides each
micro-batch's next control (finished rows leave, cancelled ones are dropped, queued requests join, the run ends
when a meeting is wanted or the batch is empty), and every rank applies the controls the way it applies a
meeting's changes, acks cancel epochs and reports its load as the headers bring them."""

from __future__ import annotations

import json
import time

from clusterctl.rank.overlap import END, MEET, Control


class InBand:
    """The step loop's side of one overlapped run (steploop.py ``StepLoop._run``)."""

    CANCEL_POLL_S = 0.05  # rank 0 looks at the cancel file this often during a run
    REPORT_S = 0.5  # load accounting and the marker's note, this often

    def __init__(self, loop):
        self.loop = loop
        self.ending = False  # rank 0: every micro-batch's next control ends its run
        self.jobs: dict = {}  # rank 0: request id -> (micro-batch, job) decided to join, until its control is applied
        self.epoch_out = loop.epoch  # rank 0: the cancel epoch the controls carry
        self._epoch_wait: set[int] = set()  # micro-batches still to be decided since the newest epoch
        self._polled = 0.0
        self._load = [0] * (3 * loop.world)
        self._slots, self._since = 0, time.monotonic()

    # -- rank 0

    def decide(self, k: int, live: list[int]) -> Control:
        loop, batch = self.loop, self.loop.batch
        self._poll_cancels(live)
        mb = batch.mbs[k]
        rows = mb.rows
        fins = [r.id for r in rows if r.done]
        drops = [r.id for r in rows if not r.done and (job := loop.inflight.get(r.id)) is not None
                 and job.cancelled.is_set()]
        # a stop; or requests wait while a micro-batch sits the run out: meet, and place them evenly
        self.ending = self.ending or loop.stop.is_set() or (len(live) < len(batch.mbs) and self._waiting() > 0)
        adds = [] if self.ending else self._joiners(k, len(fins) + len(drops), len(drops))
        if not adds and sum(self._sizes()) - len(drops) <= 0:
            self.ending = True  # nothing left to decode: meet (and idle) until work comes
        # an empty micro-batch sits the rest of the run out: its slots would only carry headers around the ring,
        # in the way of the others' (one request alone: every round would pay for two)
        park = not adds and not mb.fresh and len(rows) == len(fins) + len(drops)
        self._epoch_wait.discard(k)
        if not self._epoch_wait:
            self.epoch_out = loop.epoch
        changes = b""
        if adds or drops or fins:
            for req, job in adds:
                self.jobs[req.id] = (k, job)
            doc = {"add": [r.__dict__ for r, _ in adds], "drop": drops, **({"fin": fins} if fins else {})}
            changes = json.dumps(doc, separators=(",", ":")).encode()
        return Control(flags=END if self.ending or park else 0, changes=changes, epoch=self.epoch_out)

    def _joiners(self, k: int, leaving: int, cancelled: int) -> list:
        """Queued requests for micro-batch ``k``: up to its share of the rows once the queue is in (the batch
        split evenly, so that a burst of requests is spread over the micro-batches in one round and their prompts
        are processed side by side on the stages), within the batch's room (rows answered but still in a
        micro-batch hold their memory until their next slot)."""
        loop, batch = self.loop, self.loop.batch
        sizes = self._sizes()
        sizes[k] -= cancelled
        room = batch.max_batch - (len(batch) + len(self.jobs) - leaving)
        waiting = self._waiting()
        share = -(-(sum(sizes) + min(room, waiting)) // len(sizes))
        want = min(room, share - sizes[k])
        return loop._take(want) if want > 0 else []

    def _waiting(self) -> int:
        return len(self.loop.jobs) if self.loop.jobs is not None else 0

    def _sizes(self) -> list[int]:
        """Each micro-batch's rows not yet answered, and the requests decided to join it (not yet applied)."""
        sizes = self.loop.batch.sizes()
        for k, _ in self.jobs.values():
            sizes[k] += 1
        return sizes

    def _poll_cancels(self, live: list[int]) -> None:
        now = time.monotonic()
        if now - self._polled < self.CANCEL_POLL_S:
            return
        self._polled = now
        before = self.loop.epoch
        self.loop._apply_cancels()
        if self.loop.epoch != before:  # its drops are decided for each micro-batch in turn: then it travels
            self._epoch_wait = set(live)

    # -- every rank

    def apply(self, k: int, changes: bytes) -> None:
        loop = self.loop
        adds, drops, fins = loop._decode_changes(changes)
        if loop.leader:
            adds = [(req, self.jobs.pop(req.id, (k, None))[1]) for req, _ in adds]
        loop._apply(adds, drops, fins, into=k, soft=True)

    def received(self, c: Control) -> None:
        self.loop._ack(c.epoch)
        if self.loop.leader:
            if c.flags & MEET:
                self.ending = True
            if c.load:
                self._load = c.load

    def wants_meeting(self) -> bool:
        return self.loop.stop.is_set()

    def load_words(self) -> list[int]:
        return self.loop.load.words()

    def slot_done(self) -> None:
        loop = self.loop
        if loop.marker is not None:
            loop.marker.touch_step()
        self._slots += 1
        if time.monotonic() - self._since >= self.REPORT_S:
            self.flush()

    def flush(self) -> None:
        """Account the slots run since the last report as busy time, and report every rank's load."""
        loop, now = self.loop, time.monotonic()
        if self._slots:  # a step is a round: one slot of every micro-batch
            loop.load.recent.add(steps=self._slots / len(loop.batch.mbs), busy=now - self._since)
        self._slots, self._since = 0, now
        mine = loop.load.words()
        loop._report_load([a + b for a, b in zip(mine, self._load)] if loop.leader else mine)
