"""Rank 0's OpenAI-compatible HTTP API, and the step loop every rank runs.

Batching: concurrent requests are decoded together (``launch/rank/batch.py``: continuous batching on mlx-lm's
``BatchGenerator``, at most ``max_batch`` = the plan's batch slots). The ranks meet between runs of steps: one
8-word all_sum (and, when the batch changes, the changes' bytes: the requests that join, the ids that leave),
so the decision of which requests are in each step travels with the step and nothing is shared per token.
A new request's prompt is processed in the first step after the meeting that admits it; a request that finishes
(EOS, max_tokens, a stop string: all decided from the tokens, so on every rank at the same step) leaves at once,
its tokens are compared across ranks, and the next meeting can give its slot to a waiting request. Meetings
come about every CHECKPOINT_S of decoding whatever the model's speed (``Cadence``: rank 0 turns the measured
step rate into the number of steps to the next meeting, and that number travels in the header). Cancels and
shutdowns are voted at meetings, so they land within a meeting interval on all ranks at the same step.

Idle ranks: a rank waiting inside a collective busy-spins a core. So when idle, ranks SLEEP between meetings
instead of waiting in a collective for the next request, and meet on a shared schedule that every rank derives
from the same header count. With wake-up calls (the peer-probe port: ``peerprobe.Waker``) the schedule is slow
(every IDLE_WAKEABLE_S) and a rank that has work for the ranks — rank 0 a new request, any rank a stop — calls
the others to the next meeting at once (``IdleWait``): a request starts without waiting for the schedule, and
an idle deployment costs next to nothing. (At 10 meetings a second, 4 ranks on 2 cores spent 16-21 % of a core
each, spinning while the others were still on their way.) Without peer probes there is no wake-up call and the
schedule is fast: every 20 ms right after a request, 50 ms for the next ~5 s, then 100 ms.

Admission: rank 0 holds at most ``max_batch`` requests in the batch and ``max_queue`` waiting for a slot;
beyond that it answers 429 with Retry-After. Tokenization happens in the step loop's thread so the tokenizer is
never used from two threads.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.launch.cancelfile import RECENT_ACKS
from clusterctl.launch.rank.pipeline import (HEADER_WORDS, MAGIC, GenRequest, GenResult, agree_on_tokens,
                                        share_payload, share_words)
from clusterctl.launch.rankspec import RankSpec
from clusterctl.launch.rank.watchdog import PeerLost

KIND_IDLE, KIND_REQUEST = 0, 1
MAX_BODY = 4 << 20
MAX_STOPS = 4
CLIENT_POLL_S = 0.25  # how often a waiting HTTP thread checks that its client is still there
# how often the HTTP server's accept loop looks for a shutdown request: a rank's stop waits for it (at 0.2 s,
# rank 0 took 0.25 s from TERM to exit against 0.1 s for the other ranks; a wake-up costs a few microseconds)
HTTP_SHUTDOWN_POLL_S = 0.02
RETRY_AFTER_S = 1  # the Retry-After of a 429 (the batch frees a slot whenever a request finishes)


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


IDLE_WAKEABLE_S = 0.5  # idle meetings when ranks call each other to meetings (work brings a meeting sooner)


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

    ``check`` (rank 0: has the cancel file changed?) is asked every CHECK_S while waiting; yes counts as local
    work, so a cancel sent to an idle deployment is applied and acked at once, not at the next scheduled
    meeting."""

    CHECK_S = 0.05

    def __init__(self, call: Callable[[int], None] | None = None, check: Callable[[], bool] | None = None):
        self._call = call
        self._check = check
        self._cv = threading.Condition()
        self._local = False
        self._called = -1  # the newest meeting another rank called this one to
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

    def wait(self, timeout: float, seq: int) -> None:
        """Sleep up to ``timeout`` before meeting ``seq``."""
        if self._call is None:
            time.sleep(timeout)
            return
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (early := self._local or self._called >= seq):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, self.CHECK_S) if self._check is not None else left)
                if self._check is not None and self._check():
                    self._local = True
            call, self._local = self._local, False
            if early and not call:
                self.heard += 1
        if call:
            self.sent += 1
            self._call(seq)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- jobs

@dataclass
class Job:
    """One HTTP request waiting for, or in, generation. ``prepare`` runs in the step loop (tokenizer thread)."""

    id: str
    kind: str  # "chat" | "completion"
    prepare: Callable[[Any], GenRequest]
    stream: bool
    created: int = field(default_factory=lambda: int(time.time()))
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)  # the client left: nobody reads the answer
    started_at: float | None = None
    finished_at: float | None = None


class ActiveSet:
    """The request ids a rank is working on, published in its marker (the evidence quiescence reads).

    On rank 0 a request counts from the moment the API accepts it (queued) until both its HTTP response and its
    generation are over; on the other ranks while they generate it. Holders are counted, so the HTTP thread and
    the step loop each add and remove their own hold."""

    def __init__(self, publish: Callable[[list[str]], None] | None = None):
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self._publish = publish

    def add(self, rid: str) -> None:
        with self._lock:
            self._held[rid] = self._held.get(rid, 0) + 1
            ids = list(self._held)
        self._emit(ids)

    def remove(self, rid: str) -> None:
        with self._lock:
            n = self._held.get(rid, 0) - 1
            if n > 0:
                self._held[rid] = n
            else:
                self._held.pop(rid, None)
            ids = list(self._held)
        self._emit(ids)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def _emit(self, ids: list[str]) -> None:
        if self._publish is not None:
            self._publish(ids)


class JobQueue:
    def __init__(self, limit: int = 64):
        self._q: deque[Job] = deque()
        self._cv = threading.Condition()
        self.limit = limit
        self.on_put: Callable[[], None] | None = None  # the step loop's wake-up

    def put(self, job: Job) -> bool:
        with self._cv:
            if len(self._q) >= self.limit:
                return False
            self._q.append(job)
            self._cv.notify()
        if self.on_put is not None:
            self.on_put()
        return True

    def pop(self, timeout: float = 0.0) -> Job | None:
        with self._cv:
            if not self._q and timeout > 0:
                self._cv.wait(timeout)
            return self._q.popleft() if self._q else None

    def cancel(self, ids: list[str] | None) -> list[str]:
        """Mark queued jobs cancelled (all when ``ids`` is None); the step loop ends them when it pops them."""
        with self._cv:
            hit = [j for j in self._q if ids is None or j.id in ids]
        for j in hit:
            j.cancelled.set()
        return [j.id for j in hit]

    def drain(self) -> list[Job]:
        with self._cv:
            out = list(self._q)
            self._q.clear()
            return out


# ---------------------------------------------------------------- step loop

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
                 on_ack: Callable[..., None] | None = None, idle: IdleWait | None = None):
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
        # ranks that can call each other to meetings keep a slow idle schedule (the contract says, so all agree)
        self.idle = idle or IdleWait()
        self.wakeable = spec.probes_on
        if jobs is not None:
            jobs.on_put = self.idle.local

    def wake(self) -> None:
        """Hold the next meeting now (a stop was asked), calling the other ranks to it."""
        self.idle.local()

    def run(self) -> None:
        from clusterctl.launch.rank.batch import Batch

        self.batch = Batch(self.model, self.tokenizer, max_batch=self.spec.max_batch)
        cadence, gap, ticks = Cadence(), FIRST_CHECKPOINT, 0
        try:
            while True:
                stopping, gap = self._meet(gap)
                if stopping:
                    return
                if not self.batch:
                    if self.world > 1:
                        self.idle.wait(idle_interval(ticks, self.wakeable), self.seq)
                    ticks += 1
                    cadence, gap = Cadence(), FIRST_CHECKPOINT
                    continue
                ticks = 0
                steps = self._steps(gap)
                # a world of one meets itself for free: after every step (new requests join at once)
                gap = 1 if self.world == 1 else cadence.next_gap(steps) if self.leader else gap
        finally:
            self.batch.close()

    # -- a meeting

    def _meet(self, gap: int) -> tuple[bool, int]:
        """Agree on the batch's next changes; returns (stop, steps until the next meeting)."""
        stop_vote = 1 if self.stop.is_set() else 0
        adds: list[tuple[GenRequest, Job]] = []
        drops: list[str] = []
        if self.leader and not stop_vote:
            self._apply_cancels()
            drops = [rid for rid, j in self.inflight.items() if j.cancelled.is_set()]
            adds = self._take(self.batch.room + len(drops))
        payload = json.dumps({"add": [r.__dict__ for r, _ in adds], "drop": drops},
                             separators=(",", ":")).encode() if adds or drops else b""
        if self.world == 1:
            if stop_vote:
                self._end_all(adds)
                return True, gap
            self._apply(adds, drops)
            return False, gap
        mine = [0] * HEADER_WORDS
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
        self._ack(head[6])
        if head[3] > 0:
            self._end_all(adds)
            return True, gap
        if head[2] > 0:
            with self._guard("batch changes"):
                data = share_payload(self.group, payload if self.leader else None, head[2])
            if not self.leader:
                adds, drops = self._decode_changes(data)
        self._apply(adds, drops)
        return False, head[7]

    def _take(self, room: int) -> list[tuple[GenRequest, Job | None]]:
        """Rank 0: queued jobs for the free slots, tokenized (the tokenizer lives on this thread)."""
        out: list[tuple[GenRequest, Job | None]] = []
        while len(out) < room:
            wait = 0.1 if self.world == 1 and not self.batch and not out else 0.0
            job = self.jobs.pop(timeout=wait) if self.jobs is not None else None
            if job is None:
                break
            if job.cancelled.is_set():  # cancelled while queued: never started
                job.events.put(("done", GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0)))
                continue
            req = self._prepare(job)
            if req is not None:
                out.append((req, job))
        return out

    @staticmethod
    def _decode_changes(data: bytes) -> tuple[list, list[str]]:
        from clusterctl.atomic import strict_loads

        doc = strict_loads(data, source="shared batch changes")
        if not isinstance(doc, dict) or set(doc) != {"add", "drop"} or not isinstance(doc["drop"], list) \
                or not isinstance(doc["add"], list) or not all(isinstance(d, str) for d in doc["drop"]):
            raise IntegrityError("shared batch changes have an unexpected shape")
        return [(GenRequest.decode(json.dumps(a).encode()), None) for a in doc["add"]], doc["drop"]

    def _apply(self, adds: list, drops: list[str]) -> None:
        for rid in drops:
            res = self.batch.drop(rid, "cancelled")
            job = self.inflight.pop(rid, None)
            if res is not None:
                self.active.remove(rid)
            if job is not None:
                self._finish(job, res or GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0))
        for req, job in adds:
            emit = (lambda s, j=job: j.events.put(("text", s))) if job is not None else None
            self.batch.add(req, emit)
            self.active.add(req.id)
            if job is not None:
                job.started_at = time.monotonic()
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
            from clusterctl.launch.rank.batch import Batch

            self.batch.close()
            self.batch = Batch(self.model, self.tokenizer, max_batch=self.spec.max_batch)
            return n
        for rid, res in done:
            self.active.remove(rid)
            self.served += 1
            job = self.inflight.pop(rid, None)
            if job is not None:
                self._finish(job, res)
        return n

    def _fail_all(self, e: Exception, finished: list[str]) -> None:
        err = ApiError(500, f"generation failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                       type="server_error")
        for rid in [*self.batch.ids(), *finished]:
            self.active.remove(rid)
            job = self.inflight.pop(rid, None)
            if job is not None:
                job.events.put(("error", err))

    @staticmethod
    def _finish(job: Job, res: GenResult) -> None:
        job.finished_at = time.monotonic()
        job.events.put(("done", res))

    def _prepare(self, job: Job) -> GenRequest | None:
        try:
            return job.prepare(self.tokenizer)
        except ApiError as e:
            job.events.put(("error", e))
        except Exception as e:  # a template or tokenizer failure is the request's problem, not the rank's
            job.events.put(("error", ApiError(400, f"cannot tokenize the request: {type(e).__name__}: {e}")))
        return None

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
            raise PeerLost(f"rank {self.spec.rank}: lost a ring peer or the ring is corrupted ({what})")


# ---------------------------------------------------------------- request parsing

def _num(body: dict, name: str, default, lo=None, hi=None, kind=float):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
            or (isinstance(v, float) and not math.isfinite(v)):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' finite number'}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"{name} must be between {lo} and {hi}", param=name)
    return kind(v)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    return [s for s in stop if s]


class RequestBuilder:
    """Turns an OpenAI request body into a Job whose ``prepare`` builds the GenRequest."""

    def __init__(self, spec: RankSpec, context: int):
        self.spec = spec
        self.context = context
        self._count = 0
        self._lock = threading.Lock()

    def _seed(self, body: dict) -> int:
        if body.get("seed") is not None:
            return _num(body, "seed", 0, kind=int) & 0x7FFFFFFF
        with self._lock:
            self._count += 1
            return (self.spec.seed * 1_000_003 + self._count) & 0x7FFFFFFF

    def _common(self, body: dict, max_key: str) -> dict:
        if body.get("n", 1) not in (1, None):
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        max_tokens = body.get(max_key, body.get("max_tokens"))
        return dict(
            max_tokens=_num({"max_tokens": max_tokens}, "max_tokens", self.spec.max_tokens_default, 1,
                            self.context, kind=int),
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
            top_k=_num(body, "top_k", 0, 0, 1 << 20, kind=int),
            min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
            repetition_penalty=(_num(body, "repetition_penalty", 1.0, 0.0, 10.0)
                                if body.get("repetition_penalty") is not None else None),
            seed=self._seed(body),
            stop=_stops(body),
        )

    def _check_len(self, tokens: list[int], max_tokens: int) -> None:
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        if len(tokens) + max_tokens > self.context:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {self.context} tokens", code="context_length_exceeded")

    def completion(self, body: dict) -> Job:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        elif not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        params = self._common(body, "max_tokens")
        job_id = "cmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> GenRequest:
            if isinstance(prompt, str):
                add = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
                tokens = tokenizer.encode(prompt, add_special_tokens=add)
            else:
                vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None
                if vocab and any(t < 0 or t >= max(vocab, 1) for t in prompt):
                    raise ApiError(400, "prompt has a token id outside the vocabulary", param="prompt")
                tokens = list(prompt)
            self._check_len(tokens, params["max_tokens"])
            return GenRequest(id=job_id, tokens=list(map(int, tokens)), **params)

        return Job(id=job_id, kind="completion", prepare=prepare, stream=bool(body.get("stream")))

    def chat(self, body: dict) -> Job:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a role", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(texts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, "message content must be a string", param="messages")
            clean.append({"role": m["role"], "content": content})
        params = self._common(body, "max_completion_tokens")
        job_id = "chatcmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> GenRequest:
            if not getattr(tokenizer, "has_chat_template", True):
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            tokens = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
            self._check_len(tokens, params["max_tokens"])
            return GenRequest(id=job_id, tokens=list(map(int, tokens)), **params)

        return Job(id=job_id, kind="chat", prepare=prepare, stream=bool(body.get("stream")))


# ---------------------------------------------------------------- HTTP

class Api:
    """The HTTP side of rank 0. Listens from start-up (so /health can say 503) and serves once ``state`` is
    "serving"."""

    def __init__(self, spec: RankSpec, jobs: JobQueue, *, model_name: str, active: ActiveSet | None = None):
        self.spec = spec
        self.jobs = jobs
        self.active = active or ActiveSet()
        self.model_name = model_name
        self.state = "loading"
        self.builder: RequestBuilder | None = None
        self._key = spec.api_key_value()
        self._inflight = 0  # requests accepted and not yet answered (in the batch, queued, or being written)
        self.capacity = spec.max_batch + spec.max_queue
        self._lock = threading.Lock()
        # The listen backlog holds connections not yet accepted. socketserver's default of 5 drops the SYNs of a
        # burst of clients (64 reconnecting at once): the kernel then retries after 1 s, so /health took 1 s.
        server_class = type("RankHTTPServer", (ThreadingHTTPServer,),
                            {"request_queue_size": max(128, 2 * self.capacity)})
        try:
            self.httpd = server_class((spec.http_host, spec.http_port), _handler(self))
        except OSError as e:
            raise ConfigError(f"cannot listen on {spec.http_host}:{spec.http_port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": HTTP_SHUTDOWN_POLL_S},
                                        name="http", daemon=True)

    @property
    def endpoint(self) -> str:
        host = self.spec.http_host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def serving(self, context: int) -> None:
        self.builder = RequestBuilder(self.spec, context)
        self.state = "serving"

    def stop(self, timeout: float = 2.0) -> None:
        """Stop taking requests; fail queued ones; give streams in flight a moment to see their last event."""
        self.state = "stopping"
        for job in self.jobs.drain():
            job.events.put(("error", ApiError(503, "server is shutting down", type="server_error")))
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        self.httpd.shutdown()
        self.httpd.server_close()

    def admit(self, job: Job) -> None:
        """Take a request if the batch and the queue behind it have room; else 429 (raised as ApiError)."""
        with self._lock:
            if self._inflight >= self.capacity:
                raise ApiError(429, f"busy: {self.spec.max_batch} requests in the batch and {self.spec.max_queue} "
                                    "waiting", type="rate_limit_error", retry_after=RETRY_AFTER_S)
            self._inflight += 1
        self.active.add(job.id)
        if not self.jobs.put(job):
            self.active.remove(job.id)
            with self._lock:
                self._inflight -= 1
            raise ApiError(429, "too many queued requests", type="rate_limit_error", retry_after=RETRY_AFTER_S)

    def authorized(self, header: str | None) -> bool:
        if self._key is None:
            return True
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self._key.encode())


def _handler(api: Api):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "clusterctl"
        sys_version = ""
        # a client that sends (or reads) nothing for this long loses its connection: a slow or stalled client
        # can hold a thread, never the server
        timeout = api.spec.http_timeout_s
        # TCP_NODELAY: a response is several small writes (headers, body; a stream's chunks). With Nagle, a write
        # waits for the ACK of the one before, which the client delays (up to 40 ms, more under load).
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):  # quiet: no request logs on stderr (prompts are private)
            pass

        # -- helpers
        def send_error(self, code, message=None, explain=None):
            """http.server's own refusals (a request line or header too long, too many headers, a malformed
            request line, an unknown method) as OpenAI-style JSON errors, never its HTML page."""
            from http import HTTPStatus

            self.close_connection = True
            if not str(getattr(self, "request_version", "")).startswith("HTTP/1."):
                self.request_version = "HTTP/1.1"  # unparsed request: still answer with a status line
            headers = getattr(self, "headers", None)
            key = headers.get("Authorization") if headers is not None else None
            if code == HTTPStatus.NOT_IMPLEMENTED and not api.authorized(key):
                # an unknown method (http.server says 501 only for a parsed request) is one more route: without
                # the key the caller learns nothing, not even which methods exist
                err = ApiError(401, "invalid or missing API key", code="invalid_api_key")
                self._json(401, err.body(), {"WWW-Authenticate": "Bearer", "Connection": "close"})
                return
            try:
                phrase = HTTPStatus(code).phrase
            except ValueError:
                phrase = "error"
            err = ApiError(code, message or phrase, type="invalid_request_error" if code < 500 else "server_error")
            data = json.dumps(err.body()).encode()
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(data)

        def _json(self, status: int, obj: dict, extra: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: ApiError) -> None:
            extra = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            if e.status >= 500 or e.status == 429:
                extra = {**(extra or {}), "Connection": "close"}
                self.close_connection = True
            if e.retry_after is not None:
                extra = {**(extra or {}), "Retry-After": str(e.retry_after)}
            self._json(e.status, e.body(), extra)

        def _sse(self, obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _auth(self) -> bool:
            if api.authorized(self.headers.get("Authorization")):
                return True
            self._error(ApiError(401, "invalid or missing API key", type="invalid_request_error",
                                 code="invalid_api_key"))
            return False

        # -- routes
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/health":
                ok = api.state == "serving"
                self._json(200 if ok else 503, {"status": "ok" if ok else api.state})
            elif not self._auth():  # every route but /health: no key, no answer (not even which routes exist)
                return
            elif path in ("/v1/models", "/v1/models/" + api.model_name):
                card = {"id": api.model_name, "object": "model", "created": 0, "owned_by": "clusterctl"}
                self._json(200, card if path != "/v1/models" else {"object": "list", "data": [card]})
            else:
                self._error(ApiError(404, f"no route {path}", type="not_found_error"))

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if not self._auth():
                self._drain_body()
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._drain_body()
                self._error(ApiError(404, f"no route {path}", type="not_found_error"))
                return
            try:
                body = self._body()
                if api.state != "serving" or api.builder is None:
                    raise ApiError(503, f"not serving ({api.state})", type="server_error")
                job = api.builder.chat(body) if path == "/v1/chat/completions" else api.builder.completion(body)
                include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
                    if isinstance(body.get("stream_options") or {}, dict) else False
                want_ids = bool(body.get("return_token_ids"))
                api.admit(job)
            except ApiError as e:
                self._error(e)
                return
            try:
                self._respond(job, include_usage, want_ids)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                job.gone.set()
                job.cancelled.set()
                self.close_connection = True
            finally:
                with api._lock:
                    api._inflight -= 1
                api.active.remove(job.id)

        def _not_allowed(self):
            self._drain_body()
            if self._auth():
                self._error(ApiError(405, f"method {self.command} is not allowed", type="invalid_request_error"))

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        _poll_at = 0.0

        def _client_gone(self) -> bool:
            """The client closed its side (EOF or reset) while we wait: it will never read the answer."""
            import select
            import socket

            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                if not readable:
                    return False
                return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

        def _next(self, job: Job):
            """The job's next event; a client that went away meanwhile cancels it (at the next step boundary,
            on every rank) and the wait goes on until the step loop lets go of the job."""
            while True:
                now = time.monotonic()
                if now >= self._poll_at:  # tokens may arrive non-stop: check on a clock, not on silence
                    self._poll_at = now + CLIENT_POLL_S
                    if not job.gone.is_set() and self._client_gone():
                        job.gone.set()
                        job.cancelled.set()
                        self.close_connection = True
                try:
                    return job.events.get(timeout=CLIENT_POLL_S)
                except queue.Empty:
                    pass

        def _drain_body(self) -> None:
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = 0
            if 0 < n <= MAX_BODY:
                try:
                    self.rfile.read(n)
                except (TimeoutError, OSError):
                    self.close_connection = True
            else:
                self.close_connection = True

        def _body(self) -> dict:
            try:
                n = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                n = -1
            if n < 0:
                self.close_connection = True
                raise ApiError(411, "Content-Length is required")
            if n > MAX_BODY:
                self.close_connection = True
                raise ApiError(413, f"request body over {MAX_BODY} bytes")
            try:
                raw = self.rfile.read(n)
            except (TimeoutError, OSError):
                self.close_connection = True
                raise ApiError(408, f"the request body did not arrive within {api.spec.http_timeout_s:g} s") from None
            if len(raw) < n:
                self.close_connection = True
                raise ApiError(400, f"the request body ended after {len(raw)} of {n} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise ApiError(400, "request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            return body

        def _respond(self, job: Job, include_usage: bool, want_ids: bool) -> None:
            chat = job.kind == "chat"
            obj = "chat.completion" if chat else "text_completion"
            kind, value = self._next(job)
            if kind == "error":
                if not job.gone.is_set():
                    self._error(value)
                return
            if not job.stream:
                text = []
                while kind == "text":
                    text.append(value)
                    kind, value = self._next(job)
                if job.gone.is_set():
                    return  # the client is gone: nobody to answer
                if kind == "error":
                    self._error(value)
                    return
                result: GenResult = value
                choice: dict = {"index": 0, "finish_reason": result.finish_reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": result.text}
                else:
                    choice.update(text=result.text, logprobs=None)
                if want_ids:
                    choice["token_ids"] = result.tokens
                self._json(200, {"id": job.id, "object": obj, "created": job.created, "model": api.model_name,
                                 "choices": [choice], "usage": _usage(result)})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta: str | None, finish: str | None, role: bool = False, extra: dict | None = None):
                if chat:
                    d: dict = {}
                    if role:
                        d["role"] = "assistant"
                    if delta is not None:
                        d["content"] = delta
                    c = {"index": 0, "delta": d, "finish_reason": finish}
                else:
                    c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
                c.update(extra or {})
                out = {"id": job.id, "object": chunk_obj, "created": job.created, "model": api.model_name,
                       "choices": [c]}
                if include_usage:
                    out["usage"] = None
                self._sse(out)

            if chat:
                chunk("", None, role=True)
            while kind == "text":
                chunk(value, None)
                kind, value = self._next(job)
            if kind == "error":
                if job.gone.is_set():
                    return  # an aborted request is never reported as a server error: nobody is there
                self._sse({"error": value.body()["error"]})
                self._sse("[DONE]")
                return
            result = value
            chunk(None if chat else "", result.finish_reason,
                  extra={"token_ids": result.tokens} if want_ids else None)
            if include_usage:
                self._sse({"id": job.id, "object": chunk_obj, "created": job.created, "model": api.model_name,
                           "choices": [], "usage": _usage(result)})
            self._sse("[DONE]")

    return Handler


def _usage(r: GenResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_tokens + len(r.tokens)}


def canary_request() -> dict:
    """The request a launcher sends to prove tokens flow: POST /v1/completions with this body."""
    return {"prompt": "ping", "max_tokens": 2, "temperature": 0, "stream": False}


def context_length(config: dict) -> int:
    v = config.get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 0 else 4096
