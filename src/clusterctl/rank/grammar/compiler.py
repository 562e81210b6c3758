"""Request grammars compiled off the step loop: rank 0 compiles a request's grammar at admission, within a CPU
budget, and the step loop takes that compiled constraint when the request joins; the other ranks of a lockstep
pipeline (they sample too) compile it on their own worker when rank 0 announces the request, and it joins once
every rank has (engine/steploop.py, engine/scheduler.py: ``Scheduler.held``). No rank's step loop compiles a grammar.

Why worker threads and a CPU budget: llguidance releases the GIL while it compiles, but a compile cannot be
interrupted, and a schema under the 64 KiB cap can take seconds (2,000 optional properties: 0.7-3 s). The lexer's
fuel (mask.LEXER_FUEL) stops the costliest kind early; for the rest, each compile runs on a thread of its own at a
lower priority than the ranks' compute (``NICE``), and admission waits until that thread has used COMPILE_CPU_S of
CPU time (a measure the machine's load does not inflate), then refuses the request (400) and leaves the compile to
end on its own, its result dropped. At most MAX_WORKERS compiles run at once, so abandoned ones cannot pile up; a
schema refused for its cost is remembered (``_refused``) and refused at once. Then ``probe`` checks its first masks
before any compute.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from clusterctl.rank.engine.generation import GenRequest
from clusterctl.rank.grammar.refusal import GrammarRefused, Refusal

COMPILE_CPU_S = 0.25  # a grammar's compile may take this much CPU at admission (2,000 properties: 0.7-3 s)
MASK_CPU_S = 0.05  # ... and each of its first masks this much (a recursive $ref with required: 0.1-0.14 s)
PROBE_STEPS = 8  # admission checks the first this many tokens of a grammar's shortest answer (``probe``)
ROLLOUT_S = 0.02  # a roll-out's masks, as admission measured them, take at most this long ...
MIN_ROLLOUT_STEPS = 16  # ... but it may always take this many
MAX_WORKERS = 2  # compiles running at once (abandoned ones included)
NICE = 19  # the workers' niceness, below the compute's (priority.py: +10) (Linux; macOS: the background class)
REFUSED_MEMORY = 256  # schemas refused for their cost, remembered


@dataclass
class _Job:
    """One compile on its own thread: its CPU clock (admission watches it) and its outcome."""

    future: Future
    clock: int | None = None  # the thread's CPU-time clock id, once it runs


def _lower_priority() -> None:
    """This thread (a compile) below the step loop's priority: a compile must not take a core from the ranks."""
    try:
        if hasattr(os, "PRIO_DARWIN_THREAD"):  # macOS: per-thread background class
            os.setpriority(os.PRIO_DARWIN_THREAD, 0, os.PRIO_DARWIN_BG)
        else:  # Linux: a thread's id is a pid for setpriority
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), NICE))
    except (OSError, AttributeError):
        pass  # a platform without per-thread priority: the compile still runs off the step loop


class Compiler:
    """A rank's grammar compiles (one per rank, shared by its HTTP threads and its step loop)."""

    def __init__(self, tokenizer, *, cpu_s: float = COMPILE_CPU_S):
        self.tokenizer = tokenizer  # its factory takes ~1-2 s for a large vocabulary, and the roll-out's tables ~1 s:
        # made on a thread of its own (``warm``)
        self._made: Future | None = None
        self.cpu_s = cpu_s
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, GrammarRefused] = OrderedDict()
        self._announced: dict[str, Future] = {}  # other ranks: request id -> its compile, until it joins
        self._queue: queue.SimpleQueue | None = None  # ... compiled in order on one worker
        self.started = 0  # other ranks: compiles announced so far
        self.finished = 0  # ... and done (the meeting header reports the difference: ``pending``)

    def warm(self) -> None:
        """Start making the factory (and its roll-out tables) now, on a thread of its own."""
        with self._lock:
            if self._made is not None:
                return
            self._made = Future()

        def make():
            from clusterctl.rank.grammar.mask import GrammarFactory

            try:
                f = GrammarFactory(self.tokenizer)
                f.rollout_seconds = None  # every lockstep rank computes the same masks (RowSampler bounds rank 0's)
                f.no_openers()  # the roll-out's tables too (~1 s): not inside a request's budget
                self._made.set_result(f)
            except BaseException as e:
                self._made.set_exception(e)

        threading.Thread(target=make, name="grammar-factory", daemon=True).start()

    def factory(self) -> "grammar.GrammarFactory":
        """The rank's factory (waits for it while it is made: a wait, not CPU, on the caller's clock)."""
        self.warm()
        return self._made.result()

    # -- rank 0: admission -----------------------------------------------------------------------------------------
    def admit(self, req: GenRequest, *, wait_s: float = 30.0) -> "grammar.Constraint | None":
        """The request's grammar compiled and checked (``probe``) on a worker, or GrammarRefused:
        over the CPU budget (COMPILE_COST), a costly first mask (MASK_COST), a parser that would refuse what its mask
        allows (PARSER_LIMIT), a shortest answer longer than max_tokens (BUDGET), or invalid. Sets
        ``req.rollout_steps`` (every rank bounds its roll-outs by it). TimeoutError when ``wait_s`` passes before a worker is free."""
        if req.grammar is None:
            return None
        key = _key(req.grammar)
        with self._lock:
            known = self._refused.get(key)
        if known is not None:
            raise GrammarRefused(known.kind, str(known))
        job = self._start(lambda: self._checked(req), wait_s)
        try:
            return self._wait(job, time.monotonic() + wait_s)
        except GrammarRefused as e:
            if e.kind in (Refusal.COMPILE_COST, Refusal.MASK_COST, Refusal.PARSER_LIMIT):
                with self._lock:
                    self._refused[key] = e
                    while len(self._refused) > REFUSED_MEMORY:
                        self._refused.popitem(last=False)
            raise

    def _checked(self, req: GenRequest) -> "grammar.Constraint | None":
        f = self.factory()
        base = f.base(req.grammar)
        if base is None:
            return None
        what = "response_format" if "response_format" in req.grammar else "the tool call's grammar"
        req.rollout_steps = rollout_steps(probe(f, base, what))
        c = f.constraint(base, req.max_tokens, req.rollout_steps)
        if c.min_tokens is not None and c.min_tokens > req.max_tokens:  # forced from its first token, then cut
            raise GrammarRefused(Refusal.BUDGET, f"max_tokens {req.max_tokens} is too small for {what}: its shortest "
                                                 f"answer takes {c.min_tokens} tokens")
        return c

    def _wait(self, job: _Job, deadline: float):
        """The job's result once done; GrammarRefused COMPILE_COST once its thread used ``cpu_s`` of CPU;
        TimeoutError past ``deadline`` (a worker starved of CPU for that long: the rank is overloaded)."""
        used = 0.0
        while True:
            # a thread cannot use more CPU than the wall time that passes: the earliest the budget can run out is
            # ``cpu_s - used`` from now. Waking no sooner keeps a waiter to a few wake-ups per compile (polling
            # every 5 ms, 8 waiters at the control plane's priority woke 1,600 times a second, each taking the GIL
            # the step loop, at a lower priority, needs between its MLX calls)
            try:
                return job.future.result(timeout=min(max(self.cpu_s - (used or 0.0), 0.005),
                                                     max(deadline - time.monotonic(), 0.005)))
            except TimeoutError:
                pass
            used = _cpu(job.clock)
            if used is not None and used > self.cpu_s:
                raise GrammarRefused(Refusal.COMPILE_COST, f"compiling the request's grammar took over "
                                                           f"{self.cpu_s:g} s of CPU (too costly to enforce)")
            if time.monotonic() > deadline:
                raise TimeoutError("the grammar's compile waited too long for CPU")

    def _start(self, fn, wait_s: float | None) -> _Job:
        if not self._slots.acquire(timeout=wait_s if wait_s is not None else -1):
            raise TimeoutError(f"every grammar worker busy for {wait_s:g} s")
        job = _Job(Future())
        started = threading.Event()

        def run():
            _lower_priority()
            try:
                job.clock = time.pthread_getcpuclockid(threading.get_ident())
            except (AttributeError, OSError):
                job.clock = None
            started.set()
            try:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_result(fn())
            except BaseException as e:  # the request's grammar: its waiter (or the step loop) hears it
                job.future.set_exception(e)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        started.wait()
        return job

    # -- the other ranks of a lockstep pipeline ---------------------------------------------------------------------
    def announce(self, req: GenRequest) -> None:
        """Rank 0 announced a request that will join: compile its grammar on this rank's announcement worker, in the
        order announced (so a count of those done says which), with no budget (rank 0 admitted it, and this rank
        must make the same constraint, with the same roll-out bound)."""
        fut: Future = Future()
        self._announced[req.id] = fut
        with self._lock:
            self.started += 1
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._announcements, name="grammar-compile", daemon=True).start()
        self._queue.put((req, fut))

    def _announcements(self) -> None:
        _lower_priority()
        while True:
            req, fut = self._queue.get()
            try:
                f = self.factory()
                fut.set_result(f.compile_request(req.grammar, req.max_tokens, req.rollout_steps))
            except BaseException as e:  # the step loop hears it when the request joins (it fails alone)
                fut.set_exception(e)
            finally:
                with self._lock:
                    self.finished += 1

    @property
    def holding(self) -> bool:
        """Announced requests that have not joined (nor left) yet."""
        return bool(self._announced)

    @property
    def pending(self) -> int:
        """Announced compiles not finished yet."""
        return self.started - self.finished

    def take(self, req: GenRequest) -> "grammar.Constraint | None":
        """The step loop: the compiled constraint of an announced request that joins now (rank 0 waited until every
        rank reported it compiled). Raises what its compile raised (the request then fails alone)."""
        fut = self._announced.pop(req.id, None)
        if fut is None:
            raise GrammarRefused(Refusal.INVALID, "the request's grammar was not compiled before it joined")
        return fut.result()

    def discard(self, rid: str) -> None:
        """An announced request left before it joined (cancelled)."""
        self._announced.pop(rid, None)


def _cpu(clock: int | None) -> float | None:
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread ended
        return None


def _key(grammar: dict) -> str:
    try:
        return json.dumps(grammar, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return repr(grammar)


def probe(f: "grammar.GrammarFactory", base, what: str) -> float:
    """Check a compiled matcher before any compute, on copies: each of its first masks within MASK_CPU_S (else
    GrammarRefused MASK_COST); and along the first PROBE_STEPS tokens of its shortest answer, that its parser takes
    the longest and the shortest token its mask allows (llguidance checks its row and item limits when a token is
    consumed, not when the mask is made: such a grammar would fail mid-answer, after the compute; PARSER_LIMIT).
    Returns the CPU time of the costliest of those masks but the first, on a second walk (the first builds the
    lexer's states lazily) (llguidance releases the GIL while it makes one)."""
    import numpy as np  # (heavy: this module is imported by the control plane)

    tables = f.tables()
    lengths = np.array([len(t) for t in tables.texts])
    # twice: the first walk builds the lexer's states lazily (a first compile's masks cost up to 40x a warm one's:
    # 2.2 ms against 0.05, a bound of 16 masks where a forced call after reasoning needs 22); copies share them
    took = [_walk(f, base.deep_copy(), what, lengths) for _ in range(2)][-1]
    return max(took[1:] or took or [0.0])  # the first mask includes the lexer's set-up


def _walk(f: "grammar.GrammarFactory", m, what: str, lengths) -> list[float]:
    """``probe``'s walk along the first PROBE_STEPS tokens of ``m``'s shortest answer: each mask's CPU time."""
    import numpy as np

    tables, row = f.tables(), np.empty(f._words, dtype=np.int32)
    took, state = [], 0
    for _ in range(PROBE_STEPS):
        if m.is_stopped() or m.is_error():
            break
        t0 = time.thread_time()
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
        took.append(time.thread_time() - t0)
        if took[-1] > MASK_CPU_S:
            raise GrammarRefused(Refusal.MASK_COST, f"{what}: one token's mask took {took[-1] * 1000:.0f} ms of CPU (at "
                                                    f"most {MASK_CPU_S * 1000:.0f} ms): too costly to enforce")
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:len(tables.texts)].view(np.bool_)
        allowed = np.flatnonzero(bits)
        if not len(allowed):
            break
        order = tables.orders[1 if state else 0]
        tok = int(order[bits[order]][0])  # the roll-out's choice: the walk goes on along the shortest answer
        sizes = lengths[allowed]
        others = {int(allowed[np.argmax(sizes)]), int(allowed[np.argmin(sizes)])} - {tok}
        if not all(m.deep_copy().consume_token(t) for t in others) or not m.consume_token(tok):
            raise GrammarRefused(Refusal.PARSER_LIMIT, f"{what}: too complex to enforce (its mask allows a token its "
                                                       f"parser then refuses)")
        state = tables.scan(state, tok)
    return took


def rollout_steps(mask_s: float) -> int:
    """A roll-out's bound in masks for a grammar whose masks take ``mask_s``: ROLLOUT_S of them."""
    from clusterctl.rank.grammar.mask import ROLLOUT_STEPS  # (heavy: mlx)

    return max(MIN_ROLLOUT_STEPS, min(ROLLOUT_STEPS, int(ROLLOUT_S / max(mask_s, 1e-6))))
