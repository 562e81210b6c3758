"""What the step loop decides, pure of MLX: which queued requests join the batch and when (and, overlapped, which
micro-batch each joins), which leave it (cancelled, or answered early), the cancel epochs, and the in-flight map
of rank 0's requests. The step loop (steploop.py, runhooks.py) executes these decisions on both decode schedules; the
batch's changes travel between the ranks as one ``BatchChanges`` with one encoder and one decoder.

Fairness: requests join in the order they were queued (the queue is first in, first out); a request cancelled
while queued never takes a slot. A burst of joins in the overlapped schedule is spread over the micro-batches
(``join_count``) so their prompts are processed side by side on the stages; requests that join at a meeting go to
the micro-batches with the fewest rows (``place``)."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple

from clusterctl.atomic import strict_loads
from clusterctl.errors import IntegrityError
from clusterctl.rank.engine.requestqueue import ApiRequest, Done, RequestQueue
from clusterctl.rank.engine.generation import GenRequest, GenResult
from clusterctl.rank.engine.group import MAX_PAYLOAD
from clusterctl.protocol.runtimefiles import RECENT_ACKS, epoch_is_new

_KEYS = {"add", "drop", "fin", "ann"}


@dataclass(frozen=True)
class BatchChanges:
    """A meeting's (or an overlapped slot's) changes to the batch, the same on every rank."""

    adds: tuple[GenRequest, ...] = ()  # join now (with rank 0's prompt-cache decision in each request)
    drops: tuple[str, ...] = ()  # cancelled, or their client left
    finishes: tuple[str, ...] = ()  # overlapped: answered early (EOS, a stop string); their KV goes to the cache
    announces: tuple[GenRequest, ...] = ()  # lockstep: will join once every rank compiled their grammars

    def __bool__(self) -> bool:
        return bool(self.adds or self.drops or self.finishes or self.announces)

    def encode(self) -> bytes:
        """The bytes rank 0 shares (empty: no changes)."""
        if not self:
            return b""
        doc = {"add": [r.__dict__ for r in self.adds], "drop": list(self.drops),
               **({"fin": list(self.finishes)} if self.finishes else {}),
               **({"ann": [r.__dict__ for r in self.announces]} if self.announces else {})}
        data = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
        if len(data) > MAX_PAYLOAD:
            raise IntegrityError(f"batch changes of {len(data)} bytes exceed {MAX_PAYLOAD}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> "BatchChanges":
        """The changes rank 0 shared; a payload of any other shape is refused (the ranks would diverge)."""
        if not data:
            return cls()
        if len(data) > MAX_PAYLOAD:
            raise IntegrityError(f"batch changes of {len(data)} bytes exceed {MAX_PAYLOAD}")
        doc = strict_loads(data, source="shared batch changes")
        if not isinstance(doc, dict) or not {"add", "drop"} <= set(doc) <= _KEYS or not isinstance(doc["add"], list) \
                or not all(isinstance(d, list) and all(isinstance(x, str) for x in d)
                           for d in (doc["drop"], doc.get("fin", []))):
            raise IntegrityError("shared batch changes have an unexpected shape")
        if not isinstance(doc.get("ann", []), list):
            raise IntegrityError("shared batch changes have an unexpected shape")
        adds = tuple(_request(a) for a in doc["add"])
        announces = tuple(_request(a) for a in doc.get("ann", []))
        ids = [r.id for r in adds] + doc["drop"] + doc.get("fin", []) + [r.id for r in announces]
        if len(set(ids)) != len(ids):
            raise IntegrityError("shared batch changes name a request twice")
        return cls(adds, tuple(doc["drop"]), tuple(doc.get("fin", ())), announces)


def _request(obj) -> GenRequest:
    fields = GenRequest.__dataclass_fields__
    if not isinstance(obj, dict) or set(obj) - set(fields) or not isinstance(obj.get("id"), str) \
            or not isinstance(obj.get("tokens"), list) or not all(type(t) is int for t in obj["tokens"]) \
            or type(obj.get("max_tokens")) is not int:
        raise IntegrityError("a shared request has an unexpected shape")
    try:
        return GenRequest(**obj)
    except TypeError as e:
        raise IntegrityError(f"a shared request has an unexpected shape: {e}") from None


def join_count(sizes: list[int], k: int, room: int, waiting: int) -> int:
    """How many of the ``waiting`` requests join micro-batch ``k`` now: up to its share of the rows once the queue is
    in (the batch split evenly, the remainder to the lowest indices, so that a burst is spread over the micro-batches
    in one round and their prompts are processed side by side on the stages), within the batch's ``room``."""
    if room <= 0 or waiting <= 0:
        return 0
    total, n = sum(sizes) + min(room, waiting), len(sizes)
    share = total // n + (1 if k < total % n else 0)
    return max(0, min(room, waiting, share - sizes[k]))


def place(lengths: list[int], n: int) -> list[int]:
    """The micro-batch each of ``n`` requests joining at a meeting goes to, in order: the one with the fewest rows
    (``lengths``), counting those placed before it, the lowest index on a tie. Every rank computes it from the same
    lengths, so all place alike."""
    lengths, out = list(lengths), []
    for _ in range(n):
        k = min(range(len(lengths)), key=lengths.__getitem__)
        lengths[k] += 1
        out.append(k)
    return out


def cancelled() -> GenResult:
    """The answer of a request cancelled before it made a token (a new one each time: its receiver may fill it)."""
    return GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0)


class Epochs:
    """The cancel epochs a rank has seen: rank 0 applies a new one from its cancel file (``poll``); every rank acks
    the epoch a meeting or a control brings (``ack``). Only an epoch above the last acked counts
    (runtimefiles.epoch_is_new: the one rule the cancel file's writers and readers follow)."""

    def __init__(self, cancels=None, on_ack: Callable[..., None] | None = None):
        self.cancels, self.on_ack = cancels, on_ack
        self.epoch = 0  # rank 0: the newest epoch applied, sent to all ranks
        self.acked = 0
        self.applied: dict[int, list[str]] = {}
        # rank 0: the nonce of each epoch applied and not yet acked, and the (epoch, nonce) pairs acked lately:
        # its ack shows them, so a coordinator can tell its own cancel from an older one of the same epoch
        self.nonces: dict[int, str | None] = {}
        self.recent: deque[tuple[int, str]] = deque(maxlen=RECENT_ACKS)

    def poll(self, held: dict[str, ApiRequest], queue: RequestQueue | None) -> bool:
        """Rank 0: a new cancel epoch marks the matching requests cancelled (``held``: those rank 0 holds, and the
        queued ones). True if one came."""
        doc = self.cancels.poll() if self.cancels is not None else None
        if doc is None or not epoch_is_new(doc.epoch, self.epoch):
            return False
        applied = []
        for rid, api_req in held.items():
            if doc.requests is None or rid in doc.requests:
                api_req.cancelled.set()
                applied.append(rid)
        if queue is not None:
            applied += queue.cancel(doc.requests)
        self.epoch = doc.epoch
        self.applied[doc.epoch] = applied
        self.nonces[doc.epoch] = doc.nonce
        return True

    def ack(self, epoch: int) -> None:
        if epoch_is_new(epoch, self.acked):
            self.acked = epoch
            nonce = self.nonces.pop(epoch, None)
            if nonce is not None:
                self.recent.append((epoch, nonce))
            if self.on_ack is not None:
                self.on_ack(epoch, self.applied.pop(epoch, []), nonce=nonce, recent=list(self.recent))


class Scheduler:
    """Rank 0's decisions (every rank holds one: the others only ack epochs through it)."""

    def __init__(self, queue: RequestQueue | None, *,
                 lookup: Callable[[GenRequest], tuple[int, int] | None] | None = None,
                 cancels=None, on_ack: Callable[..., None] | None = None,
                 shared: Callable[[str], bool] | None = None):
        self.queue = queue
        self.lookup = lookup  # the prompt cache's hit for a request: (entry, tokens) or None
        self.shared = shared  # is the KV of this prompt row kept for its choices (choices.PromptShares.has)?
        self.epochs = Epochs(cancels, on_ack)
        self.inflight: dict[str, ApiRequest] = {}  # the requests in the batch, by id
        self.joining: dict[str, tuple[int | None, ApiRequest]] = {}  # decided to join (micro-batch), not yet applied
        # lockstep over several ranks (they all sample): a request with a grammar is announced first and joins once
        # every rank has compiled it off its step loop (compiler.py; rank 0 compiled it at admission)
        self.announcing = False
        self.held: deque[tuple[int, ApiRequest]] = deque()  # announced, not joined: (announcement number, request)
        self.announced = 0  # announcements made
        self.ready_below = 0  # announcements numbered below this are compiled on every rank (``compiled``)

    def waiting(self) -> int:
        return len(self.queue) if self.queue is not None else 0

    def poll_cancels(self) -> bool:
        """A new cancel epoch marks the matching requests cancelled: in the batch, decided to join it (they leave
        at the next decision after they joined), and queued. True if one came."""
        held = {**self.inflight, **{rid: api_req for rid, (_, api_req) in self.joining.items()},
                **{r.id: r for _, r in self.held}}
        return self.epochs.poll(held, self.queue)

    def compiled(self, below: int) -> None:
        """A meeting's header said the announcements numbered below ``below`` are compiled on every rank."""
        self.ready_below = max(self.ready_below, below)

    # -- joins

    def take(self, room: int, *, into: int | None = None, wait: float = 0.0) -> list[GenRequest]:
        """Queued requests for ``room`` free slots, first come first served (``wait``: how long to wait for the
        first); a request cancelled while queued is answered and takes no slot."""
        out: list[GenRequest] = []
        while len(out) < room and self.queue is not None:
            api_req = self.queue.pop(timeout=wait if not out else 0.0)
            if api_req is None:
                break
            if api_req.cancelled.is_set():  # cancelled while queued: never started
                api_req.events.put(Done(cancelled()))
                continue
            self._cache_hit(api_req.req)
            self.joining[api_req.id] = (into, api_req)
            out.append(api_req.req)
        return out

    def _cache_hit(self, req: GenRequest) -> None:
        """The prompt cache's decision for a request about to join (none: its whole prompt is processed); a choice
        row's prompt KV is its prompt row's when every rank kept it (choices.py), else it is processed again. A
        request asking its prompt's log-probabilities takes no prefix: the cache holds KV, not the logits it came
        from."""
        if req.prompt_from is not None and req.prompt_logprobs < 0 and self.shared is not None \
                and self.shared(req.prompt_from):  # (a choice scoring its prompt processes it: echo's logprobs)
            req.cache_from, req.cache_len = None, len(req.tokens) - 1
            return
        req.prompt_from = None
        hit = self.lookup(req) if self.lookup is not None and req.prompt_logprobs < 0 else None
        req.cache_from, req.cache_len = hit if hit is not None else (None, 0)

    def meeting(self, room: int, ended: list[str] = (), *, wait: float = 0.0) -> BatchChanges:
        """A meeting's changes: a new cancel epoch first, then the cancelled requests leave, the answered ones
        (overlapped: ``ended``) leave, and queued ones take the freed slots."""
        self.poll_cancels()
        leaving = tuple(rid for rid, j in self.inflight.items() if j.cancelled.is_set())
        drops = leaving + self._drop_held()
        fins = tuple(rid for rid in ended if rid not in drops)
        ready = []  # announced requests every rank has compiled: they join first (their slots were kept)
        while self.held and self.held[0][0] < self.ready_below:
            api_req = self.held.popleft()[1]
            self._cache_hit(api_req.req)  # now: what the cache held when it was announced may be gone
            self.joining[api_req.id] = (None, api_req)
            ready.append(api_req.req)
        free = room + len(leaving) + len(fins) - len(ready) - len(self.held)
        taken = self.take(free, wait=wait if not self.held else 0.0)
        announces = [r for r in taken if self.announcing and r.grammar is not None]
        for req in announces:
            self.held.append((self.announced, self.joining.pop(req.id)[1]))
            self.announced += 1
        adds = [*ready, *(r for r in taken if not (self.announcing and r.grammar is not None))]
        return BatchChanges(tuple(adds), drops, fins, tuple(announces))

    def _drop_held(self) -> tuple[str, ...]:
        """Announced requests cancelled before they joined: answered now; the other ranks forget their compiles."""
        gone = [r for _, r in self.held if r.cancelled.is_set()]
        if gone:
            self.held = deque((n, r) for n, r in self.held if not r.cancelled.is_set())
        for api_req in gone:
            api_req.events.put(Done(cancelled()))
        return tuple(r.id for r in gone)

    # -- the in-flight map (rank 0; on the other ranks every call finds nothing)

    def joined(self, rid: str) -> ApiRequest | None:
        """A request decided to join is in the batch now: its ApiRequest."""
        _, api_req = self.joining.pop(rid, (None, None))
        if api_req is not None:
            api_req.started_at = time.monotonic()
            self.inflight[rid] = api_req
        return api_req

    def left(self, rid: str) -> ApiRequest | None:
        """A request left the batch (finished, dropped, failed): its ApiRequest, whose client is answered next."""
        return self.inflight.pop(rid, None)

    def release_all(self) -> list[ApiRequest]:
        """The ranks stop: every request in the batch or about to join it."""
        out = [*self.inflight.values(), *(r for _, r in self.joining.values()), *(r for _, r in self.held)]
        self.inflight.clear()
        self.joining.clear()
        self.held.clear()
        return out


class RunEnd(str, Enum):
    """Why an overlapped run ended (each end drains the pipeline for a meeting): never because a request came."""

    STOP = "stop"  # a rank is stopping (its own signal, or another rank's vote in a header)
    EMPTY = "empty"  # nothing left to decode: the ranks meet, and idle until work comes


class SlotDecision(NamedTuple):
    """Rank 0's control of a micro-batch's next slot: its changes, whether its run ends (or it parks) there, and
    the micro-batch the changes' joins go to: itself, or (``revive``) a parked one that comes back into the run."""

    changes: BatchChanges
    end: bool
    revive: int | None = None


class OverlapRun:
    """Rank 0's decisions during one overlapped run (between two meetings): each micro-batch's next control."""

    CANCEL_POLL_S = 0.05  # rank 0 looks at the cancel file this often during a run

    def __init__(self, sched: Scheduler, n_mbs: int, max_batch: int, clock: Callable[[], float] = time.monotonic):
        self.sched, self.n, self.max_batch, self.clock = sched, n_mbs, max_batch, clock
        self.why: RunEnd | None = None  # set once: every micro-batch's next control ends its run
        self.reviving: set[int] = set()  # parked micro-batches whose revival is on its way round the ring
        self.epoch_out = sched.epochs.epoch  # the cancel epoch the controls carry
        self._epoch_wait: set[int] = set()  # micro-batches still to be decided since the newest epoch
        self._polled = -1e9

    def sizes(self, sizes: list[int]) -> list[int]:
        """Each micro-batch's rows not yet answered (``sizes``), and the requests decided to join it."""
        sizes = list(sizes)
        for k, _ in self.sched.joining.values():
            if k is not None:  # (a meeting's joins are applied at the meeting, before any run)
                sizes[k] += 1
        return sizes

    @property
    def ending(self) -> bool:
        return self.why is not None

    def end(self, why: RunEnd) -> None:
        """Every micro-batch's next control ends the run (the first reason given is the one kept)."""
        self.why = self.why or why

    def decide(self, k: int, live: list[int], rows: list[tuple[str, bool]], *, fresh: bool, mb_sizes: list[int],
               held: int, stop: bool) -> SlotDecision:
        """The changes before micro-batch ``k``'s next slot and whether its run ends there. ``rows``: its rows
        (id, answered); ``fresh``: it has requests whose prompt is not processed yet; ``mb_sizes``: every micro-batch's
        rows not yet answered; ``held``: the rows the batch holds (answered ones too); ``stop``: a meeting is
        wanted. Queued requests join ``k`` at its next slot; when ``k``'s share is full and a micro-batch sits the run
        out, they join that one instead, which comes back into the run: a join never ends the run (no meeting, no
        drained pipeline)."""
        sched = self.sched
        self._poll_cancels(live)
        self.reviving.discard(k)
        fins = tuple(rid for rid, done in rows if done)
        drops = tuple(rid for rid, done in rows if not done and (api_req := sched.inflight.get(rid)) is not None
                      and api_req.cancelled.is_set())
        if stop:
            self.end(RunEnd.STOP)
        adds: tuple[GenRequest, ...] = ()
        into = k
        if not self.ending:
            sizes = self.sizes(mb_sizes)
            sizes[k] -= len(drops)
            room = self.max_batch - (held + len(sched.joining) - len(fins) - len(drops))
            want = join_count(sizes, k, room, sched.waiting())
            parked = [i for i in range(self.n) if i not in live and i not in self.reviving]
            if want <= 0 and parked:
                into = parked[0]
                want = join_count(sizes, into, room, sched.waiting())
            adds = tuple(sched.take(want, into=into)) if want > 0 else ()
        if not adds and sum(self.sizes(mb_sizes)) - len(drops) <= 0:
            self.end(RunEnd.EMPTY)  # nothing left to decode: meet (and idle) until work comes
        revive = into if adds and into != k else None
        if revive is not None:
            self.reviving.add(revive)
            if self._epoch_wait:  # its rows' drops for the newest epoch are decided at its own slots
                self._epoch_wait.add(revive)
        self._epoch_wait.discard(k)
        if not self._epoch_wait:
            self.epoch_out = sched.epochs.epoch
        # an empty micro-batch sits the rest of the run out: its slots would only carry headers around the ring,
        # in the way of the others' (one request alone: every round would pay for two)
        park = (not adds or revive is not None) and not fresh and len(rows) == len(fins) + len(drops)
        return SlotDecision(BatchChanges(adds, drops, fins), self.ending or park, revive)

    def _poll_cancels(self, live: list[int]) -> None:
        now = self.clock()
        if now - self._polled < self.CANCEL_POLL_S:
            return
        self._polled = now
        if self.sched.poll_cancels():
            self._epoch_wait = set(live) | self.reviving  # its drops are decided for each micro-batch in turn: then it travels


# -- prompts: in groups of similar length, in chunks (overlapped schedule; prefill.py)

PAD_WASTE = 1.25  # a prompt group pads to at most this many times the tokens its prompts hold


def prompt_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of prompts to process together, shortest first: a group grows while padding everything to its
    longest costs at most PAD_WASTE times its tokens. The same lengths give the same groups on every rank."""
    groups: list[list[int]] = []
    held = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= PAD_WASTE * (held + n):
            groups[-1].append(i)
            held += n
        else:
            groups.append([i])
            held = n
    return groups


PREFILL_CHUNK = 256  # a prompt's columns per forward pass at most: the unit that flows through the stages (docs/rank.md)
MIN_PREFILL_CHUNK = 32  # ... and at least (a prompt shorter than this is one chunk)
CHUNKS_PER_STAGE = 4  # a prompt is cut into at least this many chunks per pipeline stage, down to MIN_PREFILL_CHUNK


def prefill_chunk(columns: int, stages: int, largest: int = PREFILL_CHUNK) -> int:
    """The chunk a group's prompt of ``columns`` is processed in on a pipeline of ``stages``: ``largest``, or less
    for a prompt too short to fill the pipeline with it. The pipeline fills for one chunk per extra stage, so a
    prompt of k chunks on S stages takes about t / S * (1 + (S - 1) / k): a 300-token prompt in chunks of 256 on 2
    stages is 2 chunks (0.75x one process at best), in chunks of 48 it is 7 (0.57x). On this CPU a token costs no
    more in a chunk of 32-128 columns than of 256 (bench/README.md). Every rank computes the same chunk from the
    group's shape, so the stages' sends and receives agree. One stage (or tensor parallelism): ``largest``; so is a
    quantized KV cache (plan --kv-bits: mlx-lm quantizes it after the pass that reaches its start, so the chunks'
    bounds decide its answers; overlap.py passes one stage)."""
    if stages <= 1:
        return largest
    want = -(-columns // (CHUNKS_PER_STAGE * stages))
    want = -(-want // 16) * 16  # a multiple of 16 columns
    return min(largest, max(MIN_PREFILL_CHUNK, want))


DECODE_BUDGET = 64  # prompt tokens one slot may process while rows decode, at most (slotcosts.py cuts it to their cost)


def prefill_plan(groups: list[tuple[int, int]], decoding: bool, budget: int = DECODE_BUDGET) -> list[int]:
    """Columns of each prompt group (its rows, its columns left) to process in this slot, in order. With no row
    decoding anywhere, all of them: the chunks of a prompt then flow through the stages within the slot (stage r
    on chunk c while the stage before it computes chunk c + 1). While rows decode, about ``budget`` tokens (rank 0's
    ``SlotCosts.budget``, sent with the slot's control), at least one column of the first unfinished group, so a
    joining prompt always progresses and the running streams wait for one budget per slot, not a whole prompt
    (vLLM's chunked prefill). Only data every rank holds (the groups' shapes, whether the batch has rows, the
    control's budget) goes in, so every rank processes the same chunks."""
    if not decoding:
        return [left for _, left in groups]
    out = []
    for rows, left in groups:
        take = min(left, max(budget // max(rows, 1), 0 if any(out) else 1))
        out.append(take)
        budget -= take * rows
    return out

