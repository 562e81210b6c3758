"""What an HTTP request is while it waits for, or is in, generation (``ApiRequest``), rank 0's bounded queue of
them (``RequestQueue``) and the ids each rank publishes as its active requests (``ActiveSet``): the hand-over
between the HTTP threads and the step loop. (A "job", everywhere in clusterctl, is a launch: job_id, job token.)"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from clusterctl.rank.engine.generation import GenRequest, GenResult


# -- what the step loop (and the API, at a shutdown) tells a request's HTTP thread, in order, on its ``events``
@dataclass(frozen=True)
class Text:
    """A piece of the generated text, as its stop strings let it out."""

    text: str


@dataclass(frozen=True)
class Logprob:
    """One token's log-probabilities (logprobs.py's entry): a prompt token's first (echo), then each made one's."""

    entry: dict


@dataclass(frozen=True)
class Done:
    """The generation ended: its result (finish reason, tokens, usage)."""

    result: GenResult


@dataclass(frozen=True)
class Failed:
    """The request failed: its error (api/wire.py's ApiError: the status and body its client gets)."""

    error: Exception


RequestEvent = Text | Logprob | Done | Failed

@dataclass(frozen=True)
class Echo:
    """/v1/completions' ``echo: true``: the answer's text starts with the prompt's (the string given, else its token
    ids decoded); ``score_only`` (max_tokens 0): the prompt is scored and nothing is made (one token is, inside,
    then dropped: a request always ends in a step of the batch)."""

    text: str
    score_only: bool = False


@dataclass(frozen=True)
class Prepared:
    """What preparing a request (its template and tokenizer) makes: the request to generate, completions' echo,
    and chat's splitters (a fresh one per call: one per choice, choices.py). The preparer puts them on the
    ApiRequest (admission.py); ``prepare`` itself writes into nothing."""

    req: GenRequest
    echo: Echo | None = None
    splitters: Callable[[], Any] | None = None


@dataclass
class ApiRequest:
    """One HTTP request waiting for, or in, generation. ``prepare`` (template and tokenizer) runs on its HTTP
    thread before it is queued (admission.py), and leaves ``req`` for the step loop."""

    id: str
    kind: str  # "chat" | "completion"
    prepare: Callable[[Any], Prepared]
    stream: bool
    req: GenRequest | None = None
    prepare_s: float = 0.0  # how long its template and tokenizer took
    cached_tokens: int = 0  # prompt tokens the prompt cache gave it (usage.prompt_tokens_details.cached_tokens)
    splitter: Any = None  # chat: splitter.OutputSplitter (content, reasoning, tool calls out of the text)
    splitters: Callable[[], Any] | None = None  # chat: makes another splitter (one per choice: choices.py)
    n: int = 1  # choices asked for (OpenAI's n; choices.py fans them out)
    grammar: Any = None  # its grammar's constraint, compiled at admission (compiler.py): the step loop takes it
    echo: Echo | None = None  # completions' echo: true (set when it is prepared: the prompt's text)
    created: int = field(default_factory=lambda: int(time.time()))
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)  # the client left: nobody reads the answer
    arrived_at: float = field(default_factory=time.monotonic)  # its body was read and checked
    started_at: float | None = None  # joined the batch
    first_token_at: float | None = None  # its HTTP thread saw the first generated text
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


class RequestQueue:
    def __init__(self, limit: int = 64):
        self._q: deque[ApiRequest] = deque()
        self._cv = threading.Condition()
        self.limit = limit
        self.on_put: Callable[[], None] | None = None  # the step loop's wake-up
        self.shares = None  # the step loop's choices.PromptShares (None: prompts are not shared by n choices)

    def put(self, api_req: ApiRequest) -> bool:
        with self._cv:
            if len(self._q) >= self.limit:
                return False
            self._q.append(api_req)
            self._cv.notify()
        if self.on_put is not None:
            self.on_put()
        return True

    def put_all(self, reqs: list[ApiRequest]) -> bool:
        """Queue ``reqs`` together (the choices of one request), or none of them."""
        with self._cv:
            if len(self._q) + len(reqs) > self.limit:
                return False
            self._q.extend(reqs)
            self._cv.notify()
        if self.on_put is not None:
            self.on_put()
        return True

    def __len__(self) -> int:
        return len(self._q)

    def pop(self, timeout: float = 0.0) -> ApiRequest | None:
        with self._cv:
            if not self._q and timeout > 0:
                self._cv.wait(timeout)
            return self._q.popleft() if self._q else None

    def remove(self, api_req: ApiRequest) -> bool:
        """Take a request out before the step loop pops it (its client left while it waited)."""
        with self._cv:
            for i, queued in enumerate(self._q):
                if queued is api_req:
                    del self._q[i]
                    return True
            return False

    def cancel(self, ids: list[str] | None) -> list[str]:
        """Mark queued requests cancelled (all when ``ids`` is None); the step loop ends them when it pops them."""
        with self._cv:
            hit = [r for r in self._q if ids is None or r.id in ids]
        for r in hit:
            r.cancelled.set()
        return [r.id for r in hit]

    def drain(self) -> list[ApiRequest]:
        with self._cv:
            out = list(self._q)
            self._q.clear()
            return out
