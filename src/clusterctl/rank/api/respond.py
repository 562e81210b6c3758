"""How rank 0 answers one completion request: admission (the body, the model name, the request built and
prepared), then the answer as one JSON document or as server-sent events, from the events the step loop puts
on the request's queue. A stream's headers go out at once and ``: keepalive`` comments while nothing else does
(a long prompt must not trip a first-byte timeout); a client that leaves cancels its request on every rank."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, replace

from clusterctl.rank.engine.requestqueue import ApiRequest, Done, Failed, Logprob, RequestEvent, Text
from clusterctl.rank.metrics import outcome_of
from clusterctl.rank.engine.generation import GenResult
from clusterctl.rank.api.requests import REQUESTS, ChatRequest, CompletionRequest, parse
from clusterctl.rank.api.wire import ApiError, ChatChoice, ChatCompletion, ChatDelta, Completion, TextChoice, Usage
from clusterctl.rank.engine.logprobs import chat_shape, completion_shape
from clusterctl.rank.api.splitter import Event, Reply, delta

CLIENT_POLL_S = 0.25  # how often a waiting HTTP thread checks that its client is still there
KEEPALIVE_S = 1.0  # a stream's comment line while no token comes (queued, or its prompt being processed)


@dataclass(frozen=True)
class Shape:
    """What the answer carries beyond the text, as the request asked."""

    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    token_ids: bool = False  # return_token_ids (an extension): the choice's token ids

    @classmethod
    def of(cls, request: CompletionRequest | ChatRequest) -> "Shape":
        return cls(include_usage=request.include_usage, token_ids=bool(request.return_token_ids))


class Listener:
    """An HTTP thread waiting for its request's next event: it looks whether its client is still there every
    CLIENT_POLL_S (tokens may arrive non-stop: on a clock, not on silence), calling ``on_gone`` once it left, and
    keeps a quiet stream alive with a comment every KEEPALIVE_S (one Answer, or the n choices of choices.py)."""

    def __init__(self, h, api_req: ApiRequest, on_gone):
        self.h, self.api_req, self.on_gone = h, api_req, on_gone
        self._poll_at = 0.0
        self._quiet_since = time.monotonic()

    def next(self):
        api_req, h = self.api_req, self.h
        while True:
            now = time.monotonic()
            if now >= self._poll_at:
                self._poll_at = now + CLIENT_POLL_S
                if not api_req.gone.is_set() and h.client_gone():
                    h.close_connection = True
                    self.on_gone()
            if api_req.stream and not api_req.gone.is_set() and now - self._quiet_since >= KEEPALIVE_S:
                h.keepalive()
                self._quiet_since = now
            try:
                item = api_req.events.get(timeout=CLIENT_POLL_S)
            except queue.Empty:
                continue
            self._quiet_since = time.monotonic()
            return item


def accept(api, h, kind: str) -> tuple[ApiRequest, "Shape"] | None:
    """Admission of /v1/completions ("completion") and /v1/chat/completions ("chat"): the body parsed into its
    route's model (requests.py), the request built from it, prepared and admitted (choices.py queues it), or None
    when its error was answered."""
    try:
        body = h.body()
        if not api.state.serving or api.builder is None:
            raise ApiError(503, f"not serving ({api.state.now.value})", type="server_error")
        api.check_model(body.get("model"))  # first, as OpenAI: a model not served is a 404 whatever else is wrong
        request = parse(REQUESTS[kind], body)
        api_req = api.builder.build(request, h.tenant())
        shape = Shape.of(request)
        api.admit(api_req, enqueue=api_req.n == 1)
    except ApiError as e:
        h.error(e)
        return None
    return api_req, shape


def answer(api, h, api_req: ApiRequest, write) -> None:
    """Write an admitted request's answer (``write()``); a client that leaves meanwhile cancels it; the request
    is let go of at the end."""
    try:
        write()
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        api_req.gone.set()
        api_req.cancelled.set()
        h.close_connection = True
        h.outcome = "cancelled"
    finally:
        api.release(api_req)
        api.active.remove(api_req.id)


def scored_only(r: GenResult) -> GenResult:
    """A max_tokens 0 request's result: the token made inside dropped, finished by its length (as OpenAI's legacy
    API and vLLM answer); an error or a cancel stays what it is."""
    finish = "length" if r.finish_reason in ("stop", "length") else r.finish_reason
    return replace(r, tokens=[], text="", finish_reason=finish)


def usage(r: GenResult) -> Usage:
    return Usage.of(r.prompt_tokens, len(r.tokens), r.cached_tokens)


class Answer:
    """One request's answer, written by its HTTP thread."""

    def __init__(self, api, h, api_req: ApiRequest, shape: Shape):
        self.api, self.h, self.api_req, self.shape = api, h, api_req, shape
        self.index = 0  # the choice this answer writes (choices.py: one Answer per choice)
        self.rid = api_req.id  # the answer's id (a choice's: its request's)
        self.chat = api_req.kind == "chat"
        self.listener = Listener(h, api_req, self._gone)
        self.wants_lp = api_req.req is not None and api_req.req.logprobs >= 0
        self.lps: list[dict] = []  # entries not yet written (a stream) or all of them (one document)
        self.text_at = 0  # characters of text written so far (the legacy shape's text_offset)
        self.echo = api_req.echo  # completions' echo: the prompt's text, then its entries, come first
        req = api_req.req
        self.prompt_entries = len(req.tokens) if req is not None and req.prompt_logprobs >= 0 else 0
        self.prompt_lps: list[dict] = []  # the prompt's entries (they all come before any generated token's)
        self.echoed = False  # a stream: the prompt's text went out (in its first chunk)

    def write(self) -> None:
        if self.api_req.stream:
            self.h.start_stream()
            self._stream()
        else:
            self._whole()

    # -- events

    def _next(self):
        """The request's next event. A client that went away meanwhile cancels it (at the next step boundary, on
        every rank; out of the queue at once if it still waits) and the wait goes on until the step loop lets
        go of the request. A stream gets a keepalive comment while nothing comes."""
        api_req = self.api_req
        while True:
            event = self.take(self.listener.next())
            if isinstance(event, Text) and api_req.first_token_at is None:
                api_req.first_token_at = time.monotonic()
                self.api.metrics.first_token(api_req.first_token_at - api_req.arrived_at)
            elif isinstance(event, Done):
                self._finished(event.result)
            if event is not None:
                return event

    def _gone(self) -> None:
        self.api_req.gone.set()
        self.api_req.cancelled.set()
        self.api.leave_queue(self.api_req)

    def take(self, event: RequestEvent) -> RequestEvent | None:
        """What this answer makes of one of its request's events: a log-probability entry is kept (the prompt's
        first, with echo), a max_tokens 0 request's token is dropped (Echo), its result says so; None: kept
        here, nothing for the writer."""
        score_only = self.echo is not None and self.echo.score_only
        if isinstance(event, Logprob):
            if len(self.prompt_lps) < self.prompt_entries:
                self.prompt_lps.append(event.entry)
            elif not score_only:
                self.lps.append(event.entry)
            return None
        if isinstance(event, Text) and score_only:
            return None
        if isinstance(event, Done) and score_only:
            return Done(scored_only(event.result))
        return event

    def _finished(self, result: GenResult) -> None:
        """A generation is over: its tokens, its time per output token, and a first token that came only with
        the end (all its text was held back, e.g. by a possible stop string)."""
        api_req, metrics = self.api_req, self.api.metrics
        now, n = time.monotonic(), len(result.tokens)
        metrics.tokens(result.prompt_tokens, n)
        if n and api_req.first_token_at is None:
            api_req.first_token_at = now
            metrics.first_token(now - api_req.arrived_at)
        elif n >= 2 and result.finish_reason != "cancelled":
            metrics.per_output_token((now - api_req.first_token_at) / (n - 1))

    # -- the text: through the splitter on chat (content, reasoning, tool calls), as it is on completions

    def _split(self, text: str) -> list:
        """Events of a piece of text. A splitter that wants no more (a call is complete and parallel calls are
        off) cancels the generation on every rank; its answer still ends as "tool_calls"."""

        sp = self.api_req.splitter
        if sp is None:
            return [Event("content", text)] if text else []
        events = sp.feed(text)
        if sp.should_stop and not self.api_req.cancelled.is_set():
            self.api_req.cancelled.set()
        return events

    def _end(self, result: GenResult) -> tuple[list, str]:
        """The events of the end and the answer's finish_reason."""

        sp = self.api_req.splitter
        if sp is None:
            return [], result.finish_reason
        if result.finish_reason == "cancelled" and sp.should_stop:
            events = sp.finish("stop")
        else:
            events = sp.finish(result.finish_reason)
        finish = next((e.value for e in events if e.kind == "finish"), result.finish_reason)
        return [e for e in events if e.kind != "finish"], finish

    # -- one JSON document

    def _whole(self) -> None:
        reply = Reply()
        event = self._next()
        while isinstance(event, Text):
            reply.add(self._split(event.text))
            event = self._next()
        if self.api_req.gone.is_set():
            self.h.outcome = "cancelled"
            return  # the client is gone: nobody to answer
        if isinstance(event, Failed):
            self.h.error(event.error)
            return
        result: GenResult = event.result
        choice, finish = self.choice(reply, result)
        self.h.json(200, self.document([choice], usage=usage(result)))
        self.h.outcome = "cancelled" if finish == "cancelled" else "ok"

    def choice(self, reply: Reply, result: GenResult) -> tuple[ChatChoice | TextChoice, str]:
        """The document's choice once its generation ended (``reply``: its text so far), and its finish_reason."""
        events, finish = self._end(result)
        reply.add(events)
        extra = {"token_ids": result.tokens} if self.shape.token_ids else {}
        if self.chat:
            return ChatChoice(index=self.index, message=reply.message(), logprobs=self._take_lps(),
                              finish_reason=finish, **extra), finish
        text = result.text if self.echo is None else self.echo.text + result.text
        return TextChoice(index=self.index, text=text, logprobs=self._take_lps(), finish_reason=finish,
                          **extra), finish

    def pieces(self, text: str) -> list:
        """The events of a piece of generated text (``_split``)."""
        return self._split(text)

    def _take_lps(self) -> dict | None:
        """The log-probabilities not yet written, in the shape of this route (None: not asked for)."""

        if not self.wants_lp:
            return None
        entries, self.lps = self.prompt_lps + self.lps, []
        self.prompt_lps = []
        return chat_shape(entries) if self.chat else completion_shape(entries, self.text_at)

    def document(self, choices: list, stream: bool = False, **usage) -> dict:
        """The document (or a stream's chunk) around ``choices``; ``usage`` when given (None included)."""
        api_req = self.api_req
        head = dict(id=self.rid, created=api_req.created, model=self.api.model_name,
                    system_fingerprint=self.api.fingerprint, **usage)
        if self.chat:
            return ChatCompletion(object="chat.completion.chunk" if stream else "chat.completion", choices=choices,
                                  **head).body()
        return Completion(choices=choices, **head).body()

    # -- server-sent events

    def _chunk(self, delta: dict | None, finish: str | None, extra: dict | None = None) -> None:
        """One chunk: chat's ``delta`` (content, reasoning_content, tool_calls, role) or completions' text."""
        if self.chat:
            c = ChatDelta(index=self.index, delta=delta or {}, logprobs=self._take_lps() if self.lps else None, finish_reason=finish,
                          **(extra or {}))
        else:
            text = (delta or {}).get("content") or ""
            if self.echo is not None and not self.echoed:
                text, self.echoed = self.echo.text + text, True
            c = TextChoice(index=self.index, text=text, logprobs=self._take_lps(), finish_reason=finish,
                           **(extra or {}))
            self.text_at += len(text)
        self.h.sse(self.document([c], stream=True, **({"usage": None} if self.shape.include_usage else {})))

    def _deltas(self, events: list) -> None:
        for e in events:
            d = delta(e)
            if d is not None:
                self._chunk(d, None)

    def stream_start(self) -> None:
        if self.chat:
            self._chunk({"role": "assistant", "content": ""}, None)

    def stream_text(self, text: str) -> None:
        self._deltas(self._split(text))

    def stream_end(self, result: GenResult) -> str:
        """The chunks that end the choice (its last text, its finish_reason); returns the finish_reason."""
        events, finish = self._end(result)
        self._deltas(events)
        self._chunk({} if self.chat else None, finish,
                    extra={"token_ids": result.tokens} if self.shape.token_ids else None)
        return finish

    def _stream(self) -> None:
        h, api_req = self.h, self.api_req
        self.stream_start()
        event = self._next()
        while isinstance(event, Text):
            self.stream_text(event.text)
            event = self._next()
        if isinstance(event, Failed):
            if api_req.gone.is_set():
                h.outcome = "cancelled"
                return  # an aborted request is never reported as a server error: nobody is there
            h.outcome = outcome_of(event.error.status)  # the status line said 200; the request failed
            h.sse({"error": event.error.body()["error"]})
            h.sse("[DONE]")
            return
        result: GenResult = event.result
        finish = self.stream_end(result)
        if finish == "cancelled" or api_req.gone.is_set():
            h.outcome = "cancelled"
        if self.shape.include_usage:
            h.sse(self.document([], stream=True, usage=usage(result)))
        h.sse("[DONE]")
