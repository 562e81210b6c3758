"""The step loop's hooks into an overlapped run: what a run asks of the step loop between meetings (overlap.py
``Hooks``). Rank 0's scheduler decides each micro-batch's next control (scheduler.py ``OverlapRun``: finished rows
leave, cancelled ones are dropped, queued requests join, the run ends when a meeting is wanted or the batch is
empty), and every rank applies the controls the way it applies a meeting's changes, acks cancel epochs and reports
its load as the headers bring them."""

from __future__ import annotations

import time

from clusterctl.rank.engine import prefill
from clusterctl.rank.engine.overlap import END, MEET, Control
from clusterctl.rank.engine.scheduler import BatchChanges, OverlapRun, RunEnd


class RunHooks:
    """The step loop's side of one overlapped run (steploop.py ``StepLoop._run``): overlap.py's ``Hooks``. The
    batch's changes travel in-band, in the slots' controls, not at a meeting."""

    REPORT_S = 0.5  # load accounting and the marker's note, this often

    def __init__(self, loop):
        self.loop = loop
        self.plan = OverlapRun(loop.sched, len(loop.batch.mbs), loop.batch.max_batch)
        self._load = [0] * (3 * loop.world)
        self._slots, self._since = 0, time.monotonic()

    # -- rank 0

    def decide(self, k: int, live: list[int]) -> Control:
        loop, batch = self.loop, self.loop.batch
        mb = batch.mbs[k]
        d = self.plan.decide(k, live, [(r.id, r.done) for r in mb.rows], fresh=bool(mb.fresh),
                             mb_sizes=batch.sizes(), held=len(batch), stop=loop.stop.is_set())
        return Control(flags=END if d.end else 0, changes=d.changes.encode(), epoch=self.plan.epoch_out,
                       revive=-1 if d.revive is None else d.revive, budget=prefill.budget(batch, batch.costs))

    # -- every rank

    def apply(self, k: int, changes: bytes) -> None:
        self.loop.apply(BatchChanges.decode(changes), into=k, soft=True)

    def revived(self, k: int) -> None:
        if self.loop.metrics is not None:
            self.loop.metrics.revived()

    def received(self, c: Control) -> None:
        self.loop.ack(c.epoch)
        if self.loop.leader:
            if c.flags & MEET:
                self.plan.end(RunEnd.STOP)
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

    def ended(self) -> None:
        """Rank 0: the run is over (its pipeline drained for a meeting): counted by why."""
        if self.loop.metrics is not None and self.plan.why is not None:
            self.loop.metrics.run_ended(self.plan.why.value)

    def flush(self) -> None:
        """Account the slots run since the last report as busy time, and report every rank's load."""
        loop, now = self.loop, time.monotonic()
        if self._slots:  # a step is a round: one slot of every micro-batch
            loop.load.recent.add(steps=self._slots / len(loop.batch.mbs), busy=now - self._since)
        self._slots, self._since = 0, now
        mine = loop.load.words()
        loop.report_load([a + b for a, b in zip(mine, self._load)] if loop.leader else mine)
