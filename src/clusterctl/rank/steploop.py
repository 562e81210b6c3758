"""The step loop every rank runs: meetings (the 8-word header, the batch's changes, stop votes, cancel epochs)
and runs of batched steps between them, so which requests are in a step travels with the step and nothing is
shared per token (docs/rank.md, "Step loop and sharing")."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import deque
from typing import Callable

from clusterctl.errors import IntegrityError
from clusterctl.shared.cancelfile import RECENT_ACKS
from clusterctl.rank.jobs import ActiveSet, Job, JobQueue
from clusterctl.rank.wire import ApiError
from clusterctl.rank.pipeline import (HEADER_WORDS, MAGIC, GenRequest, GenResult, agree_on_tokens,
                                        share_payload, share_words)
from clusterctl.rank.schedule import FIRST_CHECKPOINT, MAX_CHECKPOINT, Cadence, IdleWait, idle_interval
from clusterctl.shared.rankspec import RankSpec
from clusterctl.rank.watchdog import PeerLost, peer_loss
from clusterctl.atomic import strict_loads
from clusterctl.rank.batch import Batch
from clusterctl.rank.metrics import Recent
from clusterctl.rank.promptcache import PromptCache, reusable

KIND_IDLE, KIND_REQUEST = 0, 1


class LoadWords:
    """A rank's recent step time, idle share and RSS as three words of the meeting header (its own slot, the
    others zero), so rank 0 learns every rank's numbers from the all_sum it holds anyway."""

    RSS_EVERY_S = 1.0

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.recent = Recent()
        self._rss, self._rss_at = 0, -1e9

    def _rss_mb(self) -> int:
        now = time.monotonic()
        if now - self._rss_at >= self.RSS_EVERY_S:
            self._rss_at = now
            with contextlib.suppress(Exception):
                import psutil

                self._rss = psutil.Process().memory_info().rss >> 20
        return min(self._rss, 2**31 - 1)

    def words(self) -> list[int]:
        step, idle = self.recent.read()
        out = [0] * (3 * self.world)
        out[3 * self.rank:3 * self.rank + 3] = [
            min(int(step * 1e6), 2**31 - 1) + 1 if step is not None else 0,  # microseconds + 1 (0: unknown)
            int(idle * 1000) + 1 if idle is not None else 0,  # per mille + 1
            self._rss_mb() + 1]
        return out

    def read(self, words: list[int]) -> list[tuple[float | None, float | None, int | None]]:
        out = []
        for r in range(self.world):
            s, i, m = words[3 * r:3 * r + 3]
            out.append(((s - 1) / 1e6 if s > 0 else None, (i - 1) / 1000 if i > 0 else None,
                        (m - 1) << 20 if m > 0 else None))
        return out


class StepLoop:
    """Runs on the main thread of every rank until the ranks agree to stop.

    A loop of meetings and steps. At a meeting (one 8-word all_sum, and the changes' bytes when there are any)
    rank 0 says which requests join the batch and which leave it (cancelled or disconnected), how many steps
    come before the next meeting, and the newest cancel epoch; anyone can vote to stop. Then every rank applies
    the same changes and runs the same steps of the same batch. A request that finishes ends the run of steps
    early (its tokens are compared across ranks, its client gets the answer, and a waiting request can take
    its slot at once)."""

    def __init__(self, spec: RankSpec, model, tokenizer, group, *, stop: threading.Event,
                 jobs: JobQueue | None = None, marker=None, watchdog=None,
                 active: ActiveSet | None = None, cancels=None,
                 on_ack: Callable[..., None] | None = None, idle: IdleWait | None = None, metrics=None):
        self.spec, self.model, self.tokenizer, self.group = spec, model, tokenizer, group
        self.stop, self.jobs, self.marker = stop, jobs, marker
        if active is None:
            active = ActiveSet((lambda ids: marker.update(active_requests=ids)) if marker is not None else None)
        self.active = active
        self.cancels, self.on_ack = cancels, on_ack  # rank 0 reads the cancel file; every rank acks
        self.epoch = 0  # rank 0: the newest cancel epoch applied, sent to all ranks with each meeting
        self.acked = 0
        self.applied: dict[int, list[str]] = {}
        # rank 0: the nonce of each epoch applied and not yet acked, and the (epoch, nonce) pairs acked lately:
        # its ack shows them, so a coordinator can tell its own cancel from an older one of the same epoch
        self.nonces: dict[int, str | None] = {}
        self.recent: deque[tuple[int, str]] = deque(maxlen=RECENT_ACKS)
        self.inflight: dict[str, Job] = {}  # rank 0: the jobs in the batch, by request id
        self.watchdog = watchdog
        self.leader = spec.rank == 0
        self.world = spec.world_size
        self.seq = 0
        self.checkpoints = 0
        self.served = 0
        self.batch = None
        self._produced = 0  # tokens generated by the batches this loop replaced
        # ranks that can call each other to meetings keep a slow idle schedule (the contract says, so all agree)
        self.idle = idle or IdleWait()
        self.wakeable = spec.probes_on
        self.metrics = metrics  # rank 0: every rank's step time, idle share and RSS, as the meetings report them
        self.load = LoadWords(spec.rank, self.world)
        # the same budget on every rank (the contract's), off for models whose caches cannot give a prefix
        self.pcache = PromptCache(spec.prompt_cache_tokens if spec.prompt_cache_tokens and reusable(model) else 0)
        if jobs is not None:
            jobs.on_put = self.idle.local

    def wake(self) -> None:
        """Hold the next meeting now (a stop was asked), calling the other ranks to it."""
        self.idle.local()

    def _new_batch(self):
        """Lockstep (batch.py) or, for a pipeline split by our stage code, overlapped (overlap.py)."""
        from clusterctl.rank.stage import is_split

        if self.spec.overlapped and is_split(self.model):
            from clusterctl.rank.overlap import OverlapBatch

            return OverlapBatch(self.model, self.tokenizer, rank=self.spec.rank, world=self.world, group=self.group,
                                max_batch=self.spec.max_batch, pcache=self.pcache)
        return Batch(self.model, self.tokenizer, max_batch=self.spec.max_batch, pcache=self.pcache)

    @property
    def overlapped(self) -> bool:
        return self.batch is not None and hasattr(self.batch, "mbs")

    def run(self) -> None:
        self.batch = self._new_batch()
        if self.world > 1:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"rank {self.spec.rank}: decode schedule "
                                 f"{'overlap' if self.overlapped else 'lockstep'}\n")
        cadence, gap, ticks = Cadence(), FIRST_CHECKPOINT, 0
        try:
            while True:
                t0 = time.monotonic()
                stopping, gap = self._meet(gap)
                if stopping:
                    return
                if not self.batch:
                    if self.world > 1:
                        self.idle.wait(idle_interval(ticks, self.wakeable), self.seq)
                    ticks += 1
                    cadence, gap = Cadence(), FIRST_CHECKPOINT
                    self.load.recent.add(idle=time.monotonic() - t0)
                    continue
                ticks = 0
                if self.overlapped:  # runs until rank 0 asks for a meeting; it accounts its own load
                    self._run()
                    continue
                steps = self._steps(gap)
                self.load.recent.add(steps=steps, busy=time.monotonic() - t0)
                # a world of one meets itself for free: after every step (new requests join at once)
                gap = 1 if self.world == 1 else cadence.next_gap(steps) if self.leader else gap
        finally:
            self.batch.close()

    # -- a meeting

    def _meet(self, gap: int) -> tuple[bool, int]:
        """Agree on the batch's next changes; returns (stop, steps until the next meeting)."""
        stop_vote = 1 if self.stop.is_set() else 0
        adds: list[tuple[GenRequest, Job]] = []
        drops: list[str] = []  # cancelled, or their client left
        fins: list[str] = []  # overlapped: answered early (EOS, a stop string); their KV goes to the prompt cache
        if self.leader and not stop_vote:
            self._apply_cancels()
            drops = [rid for rid, j in self.inflight.items() if j.cancelled.is_set()]
            if self.overlapped:
                fins = [rid for rid in self.batch.ended() if rid not in drops]
            adds = self._take(self.batch.room + len(drops) + len(fins))
        changes = {"add": [r.__dict__ for r, _ in adds], "drop": drops, **({"fin": fins} if fins else {})}
        payload = json.dumps(changes, separators=(",", ":")).encode() if adds or drops or fins else b""
        if self.world == 1:
            self._report_load(self.load.words())
            if stop_vote:
                self._end_all(adds)
                return True, gap
            self._apply(adds, drops, fins)
            return False, gap
        mine = [0] * HEADER_WORDS + self.load.words()
        mine[3], mine[5] = stop_vote, 1
        if self.leader:
            mine[0:3] = [MAGIC, KIND_REQUEST if payload else KIND_IDLE, len(payload)]
            mine[4], mine[6], mine[7] = self.seq, self.epoch, gap
        self.checkpoints += 1 if self.batch else 0
        with self._guard("meeting" if self.batch else "idle meeting"):
            head = share_words(self.group, mine)
        self._check_ring(head[0] == MAGIC and head[4] == self.seq and head[5] == self.world
                         and 1 <= head[7] <= MAX_CHECKPOINT,
                         f"meeting header magic {head[0]:#x}, seq {head[4]} (want {self.seq}), "
                         f"{head[5]} of {self.world} ranks, next in {head[7]} steps")
        self.seq += 1
        self._report_load(head[HEADER_WORDS:])
        self._ack(head[6])
        if head[3] > 0:
            self._end_all(adds)
            return True, gap
        if head[2] > 0:
            with self._guard("batch changes"):
                data = share_payload(self.group, payload if self.leader else None, head[2])
            if not self.leader:
                adds, drops, fins = self._decode_changes(data)
        self._apply(adds, drops, fins)
        return False, head[7]

    def _report_load(self, words: list[int]) -> None:
        stats = self.load.read(words)
        if self.metrics is not None:
            for r, (step_s, idle_share, rss) in enumerate(stats):
                self.metrics.set_rank_stats(r, step_s, idle_share, None if r == self.spec.rank else rss)
        if self.marker is not None and self.batch is not None:
            step_s, idle_share, rss = stats[self.spec.rank] if self.spec.rank < len(stats) else (None, None, None)
            self.marker.note(batch=len(self.batch), step_s=step_s, idle_share=idle_share, rss_bytes=rss,
                             queued=len(self.jobs) if self.leader and self.jobs is not None else None,
                             tokens_out=self._produced + self.batch.produced if self.leader else None,
                             prompt_cache=[len(self.pcache), self.pcache.held, self.pcache.budget]
                             if self.pcache.on else None)

    def _take(self, room: int) -> list[tuple[GenRequest, Job | None]]:
        """Rank 0: queued jobs for the free slots (prepared on their HTTP threads), with their prompt-cache hits."""
        out: list[tuple[GenRequest, Job | None]] = []
        while len(out) < room:
            wait = 0.1 if self.world == 1 and not self.batch and not out else 0.0
            job = self.jobs.pop(timeout=wait) if self.jobs is not None else None
            if job is None:
                break
            if job.cancelled.is_set():  # cancelled while queued: never started
                job.events.put(("done", GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0)))
                continue
            req = job.req
            hit = self.pcache.lookup(req.tokens, req.partition) if self.pcache.on else None
            if hit is not None:
                req.cache_from, req.cache_len = hit
            out.append((req, job))
        return out

    @staticmethod
    def _decode_changes(data: bytes) -> tuple[list, list[str], list[str]]:
        doc = strict_loads(data, source="shared batch changes")
        if not isinstance(doc, dict) or not {"add", "drop"} <= set(doc) <= {"add", "drop", "fin"} \
                or not isinstance(doc["add"], list) \
                or not all(isinstance(d, list) and all(isinstance(x, str) for x in d)
                           for d in (doc["drop"], doc.get("fin", []))):
            raise IntegrityError("shared batch changes have an unexpected shape")
        return ([(GenRequest.decode(json.dumps(a).encode()), None) for a in doc["add"]], doc["drop"],
                doc.get("fin", []))

    def _apply(self, adds: list, drops: list[str], fins: list[str] = (), *, into: int | None = None,
               soft: bool = False) -> None:
        """The batch's changes, on every rank alike. ``into``: the micro-batch new requests join (overlapped);
        ``soft``: a prompt-cache entry rank 0 chose may have been evicted since (it decided during a run): the
        request then processes its whole prompt, on every rank alike."""
        # the prompt cache's prefixes first: the KV saved by the requests leaving now may evict an entry
        prefixes = {req.id: p for req, _ in adds if req.cache_from is not None
                    and (p := self.pcache.take(req.cache_from, req.cache_len, missing_ok=soft)) is not None}
        if self.metrics is not None:
            for req, _ in adds:
                if req.id in prefixes:
                    self.metrics.cache_hit(req.cache_len)
        for rid in fins:
            self.batch.drop(rid, "stop", save=True)
            if not self.leader:  # rank 0 let it go when it answered it (_done)
                self.active.remove(rid)
        for rid in drops:
            res = self.batch.drop(rid, "cancelled")
            job = self.inflight.pop(rid, None)
            if res is not None:
                self.active.remove(rid)
            if job is not None:
                self._finish(job, res or GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0))
        for req, job in adds:
            emit = (lambda s, j=job: j.events.put(("text", s))) if job is not None else None
            emit_lp = (lambda e, j=job: j.events.put(("logprob", e))) if job is not None else None
            self.batch.add(req, emit, prefix=prefixes.get(req.id), emit_lp=emit_lp,
                           **({"into": into} if into is not None else {}))
            self.active.add(req.id)
            if job is not None:
                job.started_at = time.monotonic()
                job.cached_tokens = req.cache_len if req.id in prefixes else 0
                self.inflight[req.id] = job

    def _end_all(self, adds: list) -> None:
        """The ranks stop: every request in the batch (and any just taken from the queue) gets a 503."""
        for rid in self.batch.ids():
            self.batch.drop(rid, "shutdown")
            self.active.remove(rid)
        jobs = list(self.inflight.values()) + [j for _, j in adds if j is not None]
        self.inflight.clear()
        for job in jobs:
            job.events.put(("error", ApiError(503, "server is shutting down", type="server_error")))

    # -- steps

    def _steps(self, gap: int) -> int:
        """Up to ``gap`` steps of the batch, fewer when a request finishes; then the step in flight is drained
        (the next meeting is a collective of its own). Returns the number of steps run."""
        import mlx.core as mx

        n, done = 0, []
        try:
            while n < gap and self.batch and not done:
                done = self.batch.step()
                n += 1
                if self.marker is not None:
                    self.marker.touch_step()
            mx.synchronize(self.batch.gen.stream)
            if done:
                with self._guard("token agreement"):
                    flat = [t for _, r in done for t in (*r.tokens, -1)]
                    agreed = self.world == 1 or agree_on_tokens(self.group, self.spec, flat)
                if not agreed:
                    raise IntegrityError(f"rank {self.spec.rank}: ranks produced different tokens for "
                                         f"{', '.join(rid for rid, _ in done)}")
        except Exception as e:
            self._fail_all(e, [rid for rid, _ in done])
            if self.world > 1 or not isinstance(e, (ValueError, RuntimeError)):
                raise  # ranks may now be out of step: the rank must end
            self.batch.close()
            self._produced += self.batch.produced
            self.batch = self._new_batch()
            return n
        for rid, res in done:
            self.active.remove(rid)
            self.served += 1
            job = self.inflight.pop(rid, None)
            if job is not None:
                self._finish(job, res)
        return n

    def _run(self) -> None:
        """Overlapped: slots of every micro-batch until rank 0 wants a meeting; requests join and leave in
        between (inband.py); rank 0 answers each request as it finishes."""
        from clusterctl.rank.inband import InBand

        control = InBand(self)
        try:
            self.batch.run(control, self.seq, on_done=self._done)
        except Exception as e:
            self._fail_all(e, [])
            raise  # ranks may now be out of step: the rank must end
        control.flush()

    def _done(self, rid: str, res: GenResult) -> None:
        self.active.remove(rid)
        self.served += 1
        job = self.inflight.pop(rid, None)
        if job is not None:
            self._finish(job, res)

    def _fail_all(self, e: Exception, finished: list[str]) -> None:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        lost = e if isinstance(e, PeerLost) else peer_loss(e, self.spec.rank)
        if lost is not None:  # the deployment failed, not the request: retry later (a supervisor may heal it)
            err = ApiError(503, f"the deployment stopped serving: {lost.message}", type="server_error",
                           code="deployment_unavailable", retry_after=5)
        else:
            err = ApiError(500, f"generation failed: {why}", type="server_error")
        for rid in [*self.batch.ids(), *finished]:
            self.active.remove(rid)
            job = self.inflight.pop(rid, None)
            if job is not None:
                job.events.put(("error", err))

    @staticmethod
    def _finish(job: Job, res: GenResult) -> None:
        job.finished_at = time.monotonic()
        res.cached_tokens = job.cached_tokens
        if res.error is not None:  # the request's own values failed it (sampling.py): its client alone hears it
            job.events.put(("error", ApiError(400, res.error)))
            return
        job.events.put(("done", res))

    def _apply_cancels(self) -> None:
        """Rank 0: a new cancel epoch cancels the matching requests now (in flight and queued); the epoch then
        travels with the next meeting. A world of one acks at once."""
        if self.cancels is None:
            return
        doc = self.cancels.poll()
        if doc is None:
            return
        applied = []
        for rid, job in list(self.inflight.items()):
            if doc.requests is None or rid in doc.requests:
                job.cancelled.set()
                applied.append(rid)
        if self.jobs is not None:
            applied += self.jobs.cancel(doc.requests)
        self.epoch = doc.epoch
        self.applied[doc.epoch] = applied
        self.nonces[doc.epoch] = doc.nonce
        if self.world == 1:
            self._ack(doc.epoch)

    def _ack(self, epoch: int) -> None:
        if epoch > self.acked:
            self.acked = epoch
            nonce = self.nonces.pop(epoch, None)
            if nonce is not None:
                self.recent.append((epoch, nonce))
            if self.on_ack is not None:
                self.on_ack(epoch, self.applied.pop(epoch, []), nonce=nonce, recent=list(self.recent))

    def _guard(self, what: str):
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.guard(self.spec.control_timeout_s, what)

    def _check_ring(self, ok: bool, what: str) -> None:
        # A broken ring does not always raise: MLX can hand back a stale buffer ("Failing pending tasks"), so
        # every meeting carries a sequence number and a head count.
        if not ok:
            raise PeerLost.ring(self.spec.rank, what)
