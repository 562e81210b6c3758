"""n choices of one request (OpenAI's ``n``): its fan-out into n rows of the batch that share one processing of the
prompt, and the merge of the rows' outputs into one answer (its choices by ``index``).

Merge. The rows' events come to the request's one queue tagged with their choice (``ChoiceEvent``); one
``respond.Answer`` per choice turns them into its choice (its own splitter, grammar, logprobs, finish_reason);
``Choices`` writes them as one document or as a stream whose chunks interleave the choices by ``index``, then
``[DONE]`` once every choice ended. ``usage`` counts the prompt once and every choice's tokens. A client that
leaves cancels every row; an error of one row (its own values failed it) ends the whole answer.

The prompt once. A request with n > 1 first sends a prompt row (``GenRequest.keep_prompt`` = n: its prompt, one
greedy token nobody reads): it joins the batch like any request (the prompt cache may give it a prefix) and, when it
leaves, every rank keeps its KV in ``PromptShares`` under its id instead of the prompt cache. Then the n choice rows
join, each taking a copy of the KV of all but the prompt's last token (``GenRequest.prompt_from``) and processing
that one token: the prompt's work is done once plus n tokens, not n times (bench/choices.py measures it). Every rank
keeps and takes the shares in the same order (a row leaves or joins at the same point of the batch everywhere), so
every rank makes the same rows, on both schedules and both parallelisms; rank 0 lets the rows join only after its own
copy was kept, so their joins come after the keep on every rank. Models whose layers do not all keep a plain
KVCache (sliding windows, state caches: ``shares_prompts``, decided alike on every rank) have no prefix to share:
their n rows each process the prompt.

Seeds (docs/api.md): choice i of a request with seed s samples with ``choice_seed(s, i)``: s itself for choice 0 (what
the request draws with n = 1) and a hash of (s, i) for the others, so choice i is the same whatever n is. Each row
draws from a key of its own (sampling.py), so the rows do not disturb each other.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from clusterctl.errors import IntegrityError
from clusterctl.rank.engine.generation import GenResult
from clusterctl.rank.metrics import outcome_of
from clusterctl.rank.engine.promptcache import MIN_REUSE, prefix_copy
from clusterctl.rank.engine.requestqueue import ApiRequest, Done, Failed, RequestEvent, Text
from clusterctl.rank.api.respond import Answer, Listener, Shape, accept, answer
from clusterctl.rank.api.splitter import Reply
from clusterctl.rank.api.wire import ApiError, Usage
from clusterctl.modelfiles.archs import build_lazy, cache_kinds, small_config

DEFAULT_MAX_N = 8  # the most choices a request may ask for unless the operator said (plan --max-n)
# prompts kept for their choices (each one sequence's KV beyond the plan's rows, while its choices wait to join); a
# choice cancelled before it joined never takes its copy, so the oldest goes; a share gone: its choices process the
# prompt each
MAX_SHARES = 4
KEPT_WAIT_S = 5.0  # how long rank 0 waits for a prompt row's KV to be kept before its choices join without it


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (an unsigned 64-bit MLX seed)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def shares_prompts(config: dict) -> bool:
    """Does every layer of the model (not only this rank's: a pipeline rank holds a slice, and the ranks must
    agree) keep a plain KVCache, whose prefix a choice can take? Decided from config.json alone, on a toy-size
    model of the same class and blocks (archs.small_config, every layer kept), so every rank decides alike."""
    def all_layers(small: dict, full: dict) -> dict:
        out = dict(small)
        for k in ("num_hidden_layers", "layer_types"):
            if k in full:
                out[k] = full[k]
        if isinstance(full.get("text_config"), dict) and isinstance(out.get("text_config"), dict):
            out["text_config"] = all_layers(out["text_config"], full["text_config"])
        return out

    try:
        return all(k == "KVCache" for k in cache_kinds(build_lazy(all_layers(small_config(config), config))))
    except Exception:  # a class mlx-lm cannot build at toy size: nothing is shared (each choice processes its prompt)
        return False


def shareable(tokens: list[int]) -> bool:
    """Is a prompt long enough to be processed once for its choices (as long as a prompt-cache prefix must be)?"""
    return len(tokens) - 1 >= MIN_REUSE


@dataclass
class _Share:
    cache: list  # per layer: mlx-lm's single-sequence KVCache of the prompt
    count: int  # tokens held
    takers: int  # choice rows still to take it


class PromptShares:
    """Every rank: the KV of prompt rows that left the batch, until their choice rows took it. Changes only by
    ``keep`` (a prompt row leaves) and ``take`` (a choice row joins), in the same order on every rank; at most
    MAX_SHARES are kept (the oldest goes first: the same everywhere)."""

    def __init__(self):
        self._kept: OrderedDict[str, _Share] = OrderedDict()
        self._waiting: dict[str, threading.Event] = {}  # rank 0: prompt rows whose HTTP thread waits for the keep

    def __len__(self) -> int:
        return len(self._kept)

    def expect(self, rid: str) -> threading.Event:
        """Rank 0's HTTP thread, before it queues prompt row ``rid``: set once its KV is kept."""
        ev = self._waiting[rid] = threading.Event()
        return ev

    def unexpect(self, rid: str) -> None:
        self._waiting.pop(rid, None)

    def keep(self, rid: str, cache: list, count: int, takers: int) -> None:
        import mlx.core as mx

        if count > 0 and takers > 0:
            mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
            self._kept[rid] = _Share(cache=cache, count=count, takers=takers)
            while len(self._kept) > MAX_SHARES:
                self._kept.popitem(last=False)
        ev = self._waiting.pop(rid, None)
        if ev is not None:
            ev.set()

    def has(self, rid: str) -> bool:
        return rid in self._kept

    def take(self, rid: str, n: int, *, missing_ok: bool = False) -> list | None:
        """The first ``n`` tokens of prompt row ``rid``'s KV as a fresh cache (``missing_ok``: None when it is gone,
        evicted since rank 0 chose it; gone on every rank alike)."""
        s = self._kept.get(rid)
        if s is None and missing_ok:
            return None
        if s is None or not 0 < n <= s.count:
            raise IntegrityError(f"the prompt of {rid} ({n} tokens) is not kept on this rank: the ranks disagree")
        s.takers -= 1
        if s.takers <= 0:
            del self._kept[rid]
        return [prefix_copy(c, n) for c in s.cache]


# -- the fan-out (rank 0's HTTP thread)

PROMPT = -1  # the choice index of a prompt row's events
EVERY = -2  # an event the API put for the whole request (a shutdown, a lost peer): it ends every choice
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ChoiceEvent:
    """One event of a row, as the step loop put it (requestqueue.py: Text, Logprob, Done, Failed), and the choice
    it belongs to."""

    index: int
    event: RequestEvent


class Tagged:
    """A row's event queue as the step loop sees it: what it puts goes to its request's one queue, tagged."""

    def __init__(self, into: queue.Queue, index: int):
        self.into, self.index = into, index

    def put(self, event: RequestEvent) -> None:
        self.into.put(ChoiceEvent(self.index, event))


def prompt_row(base: ApiRequest) -> ApiRequest:
    """The row that processes the prompt once for the choices: one greedy token nobody reads, no grammar, no
    logprobs, nothing that could fail it but the prompt itself."""
    r = replace(base.req, id=f"{base.id}-prompt", max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                repetition_penalty=None, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, stop=[],
                logprobs=-1, grammar=None, rollout_steps=None, keep_prompt=base.n)
    return ApiRequest(id=r.id, kind=base.kind, prepare=base.prepare, stream=False, req=r, created=base.created,
                      events=Tagged(base.events, PROMPT))


def choice_rows(base: ApiRequest, constraint, prompt_from: str | None) -> list[ApiRequest]:
    """The n rows of a request: its GenRequest with the choice's id and seed, each its own splitter and grammar
    constraint (``constraint(req)`` compiles another: the compiled grammar is cached, a constraint holds a row's
    state)."""
    rows = []
    for i in range(base.n):
        r = replace(base.req, id=f"{base.id}-{i}", seed=choice_seed(base.req.seed, i), prompt_from=prompt_from)
        fresh = i > 0
        rows.append(ApiRequest(
            id=r.id, kind=base.kind, prepare=base.prepare, stream=base.stream, req=r, created=base.created,
            splitter=base.splitters() if fresh and base.splitters is not None else base.splitter,
            grammar=constraint(r) if fresh and base.grammar is not None else base.grammar,
            echo=base.echo, events=Tagged(base.events, i)))
    return rows


def serve(api, h, kind: str) -> None:
    """Route body of /v1/completions ("completion") and /v1/chat/completions ("chat"): one choice as
    respond.Answer writes it, n as ``Choices`` does."""
    got = accept(api, h, kind)
    if got is None:
        return
    api_req, shape = got
    writer = Answer(api, h, api_req, shape) if api_req.n == 1 else Choices(api, h, api_req, shape)
    answer(api, h, api_req, writer.write)


class Choices:
    """The answer of a request with n > 1 choices, written by its HTTP thread."""

    def __init__(self, api, h, base: ApiRequest, shape: Shape):
        self.api, self.h, self.base, self.shape = api, h, base, shape
        self.prompt: ApiRequest | None = None
        self.rows: list[ApiRequest] = []
        self.answers: list[Answer] = []
        self.results: dict[int, GenResult] = {}
        self.listener = Listener(h, base, lambda: self._cancel(gone=True))

    def write(self) -> None:
        try:
            self._write()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self._cancel(gone=True)  # the client left mid-write: every row ends (respond.answer ends the request)
            raise

    def _write(self) -> None:
        if self.base.stream:
            self.h.start_stream()
        try:
            self._share_prompt()
            if not self.base.gone.is_set():
                self._queue_rows()
        except ApiError as e:
            self._failed(e)
            return
        if self.base.gone.is_set():
            self.h.outcome = "cancelled"
            return
        if self.base.stream:
            self._stream()
        else:
            self._whole()

    # -- the rows

    def _share_prompt(self) -> None:
        """The prompt row first, and a wait until rank 0 kept its KV (every rank keeps it at the same point of the
        batch's changes, so before the choices, queued only now, join anywhere)."""
        shares = self.api.queue.shares
        if shares is None or not shareable(self.base.req.tokens) or self.base.req.prompt_logprobs >= 0:
            return  # (echo's logprobs: each choice scores its prompt, which needs its logits, not a shared KV)
        p = self.prompt = prompt_row(self.base)
        kept = shares.expect(p.id)
        try:
            if not self.api.queue.put(p):
                raise ApiError(429, "too many queued requests", type="rate_limit_error", retry_after=RETRY_AFTER_S)
            while True:
                ev = self._next()
                if isinstance(ev.event, Failed):
                    raise ev.event.error
                if ev.index == PROMPT and isinstance(ev.event, Done):
                    break
            if ev.event.result.finish_reason in ("stop", "length"):
                kept.wait(KEPT_WAIT_S)  # (not kept: the choices process the prompt each)
        finally:
            shares.unexpect(p.id)

    def _queue_rows(self) -> None:
        factory = self.api.compiler.factory if self.api.compiler is not None else None

        def constraint(req):
            return factory().compile_request(req.grammar, req.max_tokens, req.rollout_steps)

        # (rank 0's scheduler takes the prompt's KV only if every rank kept it: scheduler._cache_hit)
        self.rows = choice_rows(self.base, constraint, self.prompt.id if self.prompt is not None else None)
        for i, row in enumerate(self.rows):
            a = Answer(self.api, self.h, row, self.shape)
            a.index, a.rid = i, self.base.id
            self.answers.append(a)
        if not self.api.queue.put_all(self.rows):
            raise ApiError(429, "too many queued requests", type="rate_limit_error", retry_after=RETRY_AFTER_S)

    # -- events

    def _next(self) -> ChoiceEvent:
        """The next event of any row. A client that went away meanwhile cancels every row (and the wait goes on
        until each lets go); a stream gets a keepalive comment while nothing comes."""
        item = self.listener.next()
        return item if isinstance(item, ChoiceEvent) else ChoiceEvent(EVERY, item)

    def _cancel(self, *, gone: bool) -> None:
        """Every row ends (queued ones at once, the others at the next step boundary on every rank)."""
        for r in (self.base, *([self.prompt] if self.prompt is not None else []), *self.rows):
            if gone:
                r.gone.set()
            r.cancelled.set()
            if r is not self.base:
                self.api.leave_queue(r)

    def _collect(self, on_text, on_done=None) -> ApiError | None:
        """Every row's events until each ended: text to ``on_text(answer, text)``, each result kept and given to
        ``on_done(answer, result)``; the first error (of a row, or of the whole request) cancels the others and is
        returned."""
        left = set(range(len(self.rows)))
        while left:
            ev = self._next()
            if isinstance(ev.event, Failed):
                self._cancel(gone=False)
                return ev.event.error
            if ev.index < 0:  # (the prompt row's last words)
                continue
            a = self.answers[ev.index]
            event = a.take(ev.event)  # (its log-probabilities kept; echo's max_tokens 0: its token dropped)
            if isinstance(event, Text):
                if self.base.first_token_at is None:
                    self.base.first_token_at = time.monotonic()
                    self.api.metrics.first_token(self.base.first_token_at - self.base.arrived_at)
                on_text(a, event.text)
            elif isinstance(event, Done):
                left.discard(ev.index)
                self.results[ev.index] = event.result
                if on_done is not None:
                    on_done(a, event.result)
        self.base.finished_at = time.monotonic()
        completion = sum(len(r.tokens) for r in self.results.values())
        self.api.metrics.tokens(len(self.base.req.tokens), completion)
        return None

    def _usage(self) -> Usage:
        """The prompt once, every choice's tokens; cached: what the prompt cache gave the prompt's processing."""
        cached = self.prompt.cached_tokens if self.prompt is not None else self.rows[0].cached_tokens
        return Usage.of(len(self.base.req.tokens), sum(len(r.tokens) for r in self.results.values()), cached)

    def _outcome(self, finishes: list[str]) -> None:
        gone = self.base.gone.is_set()
        self.h.outcome = "cancelled" if gone or all(f == "cancelled" for f in finishes) else "ok"

    def _failed(self, err: ApiError) -> None:
        if self.base.gone.is_set():
            self.h.outcome = "cancelled"
            return  # nobody to answer
        if not self.base.stream:
            self.h.error(err)
            return
        self.h.outcome = outcome_of(err.status)  # the status line said 200; the request failed
        self.h.sse({"error": err.body()["error"]})
        self.h.sse("[DONE]")

    # -- one JSON document, or server-sent events

    def _whole(self) -> None:
        replies = [Reply() for _ in self.rows]
        err = self._collect(lambda a, text: replies[a.index].add(a.pieces(text)))
        if err is not None or self.base.gone.is_set():
            self._failed(err)
            return
        made = [a.choice(replies[i], self.results[i]) for i, a in enumerate(self.answers)]
        self.h.json(200, self.answers[0].document([c for c, _ in made], usage=self._usage()))
        self._outcome([f for _, f in made])

    def _stream(self) -> None:
        for a in self.answers:
            a.stream_start()
        finishes: dict[int, str] = {}

        err = self._collect(lambda a, text: a.stream_text(text),
                            lambda a, result: finishes.__setitem__(a.index, a.stream_end(result)))
        if err is not None or self.base.gone.is_set():
            self._failed(err)
            return
        if self.shape.include_usage:
            self.h.sse(self.answers[0].document([], stream=True, usage=self._usage()))
        self.h.sse("[DONE]")
        self._outcome(list(finishes.values()))
