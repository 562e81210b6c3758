"""What one request is to the ranks: the ``GenRequest`` rank 0 shares once and every rank derives the identical
generation from, the ``GenResult`` it ends with, the ``StopMatcher`` that finds its stop strings in the text, and
``Seq``, its output as it is made, on both decode schedules (batch.py, overlap.py): each sampled token through EOS,
the detokenizer and the stop strings (``Seq.feed``), and the result."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional

from clusterctl.atomic import strict_loads
from clusterctl.errors import IntegrityError


@dataclass
class GenRequest:
    """What rank 0 shares once per request; every rank derives the identical generation from it."""

    id: str
    tokens: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    logit_bias: Optional[dict[str, float]] = None  # token id (as a JSON key) -> additive bias
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: int = -1  # rank 0 reports each token's log-probability and this many alternatives (-1: none)
    # echo with logprobs: every prompt token's log-probability and this many alternatives too (-1: none); every rank
    # reads it (the lockstep ranks evaluate the scoring graph together: promptlogprobs.py); never from the cache
    prompt_logprobs: int = -1
    # structured output (grammar/mask.py): {"response_format": {...}}, or {"lark": "..."} (a forced tool call, text without
    # the call marker under tool_choice "none"), with the response_format beside it when it is the JSON after reasoning
    grammar: Optional[dict] = None
    # the grammar's roll-out bound in masks (grammar/mask.py), rank 0's choice at admission from what one of its masks costs
    rollout_steps: Optional[int] = None
    # rank 0's prompt-cache decision (promptcache.py): reuse the first cache_len tokens of entry cache_from
    cache_from: Optional[int] = None
    cache_len: int = 0
    # rank 0's prompt-cache partition: a hash of the caller's tenant and cache_salt (only the same one reuses)
    partition: Optional[str] = None
    # n choices (choices.py): a prompt row keeps its prompt's KV for this many choice rows when it leaves the batch;
    # a choice row takes it from the prompt row of this id (then processes only its prompt's last token)
    keep_prompt: int = 0
    prompt_from: Optional[str] = None

    @property
    def took(self) -> tuple[int, int] | None:
        return (self.cache_from, self.cache_len) if self.cache_from is not None else None

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "GenRequest":
        obj = strict_loads(data, source="shared request")
        if not isinstance(obj, dict) or set(obj) - set(cls.__dataclass_fields__):
            raise IntegrityError("shared request has an unexpected shape")
        return cls(**obj)


@dataclass
class GenResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "shutdown" | "error"
    prompt_tokens: int
    error: Optional[str] = None  # "error": why this request failed (its own values, not the rank's state)
    cached_tokens: int = 0  # prompt tokens whose KV the prompt cache gave (not computed again)


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could still start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at = min(i for i, _ in hits)
            self.pending = ""
            return text[:at], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Seq:
    """One request's output as it is made: its tokens and text so far (lockstep: one row of the batch; overlapped:
    rank 0's side of a row)."""

    req: GenRequest
    uid: int
    detok: object
    emit: Callable[[str], None] | None = None
    tokens: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    stops: StopMatcher = None  # type: ignore[assignment]
    stopped_by_text: bool = False
    last: int | None = None  # the last token sampled (an EOS included): a grammar consumes it at the end
    guard: object = None  # sampling.Guard of a request whose sampling can fail (None: plain greedy)
    lp: object = None  # rank 0: logprobs.Entries of a request that asked for log-probabilities
    emit_lp: Callable[[dict], None] | None = None
    procs: list = field(default_factory=list)  # its logits processors (a grammar among them: closed_by_budget)

    @property
    def lists_eos(self) -> bool:
        """An echoed prompt's entries end with the answer's last token, an EOS too (OpenAI's legacy API lists its
        <|endoftext|>): lm-evaluation-harness drops that last entry (``[ctxlen:-1]``) whatever it is."""
        return self.req.prompt_logprobs >= 0

    def out(self, s: str) -> None:
        if s:
            self.parts.append(s)
            if self.emit is not None:
                self.emit(s)

    def feed(self, token: int, *, eos: bool, otherwise: str | None) -> str | None:
        """One sampled token; returns how the request finishes with it. An EOS token ends it ("stop") and is not
        part of the text; any other joins the tokens and goes through the detokenizer and the stop strings into
        the text: "stop" when a stop string ends it, else ``otherwise`` (the schedule's own word: "length" at
        max_tokens, None to go on)."""
        self.last = token
        if eos:
            return "stop"
        self.tokens.append(token)
        self.detok.add_token(token)
        text, hit = self.stops.feed(self.detok.last_segment)
        self.out(text)
        if hit:
            self.stopped_by_text = True
            return "stop"
        return otherwise

    def so_far(self, finish: str, error: str | None = None) -> GenResult:
        """The result of what it made so far (taken out early: cancelled, shutdown; ``error``: its sampling
        failed)."""
        return GenResult(tokens=self.tokens, text="".join(self.parts), finish_reason=finish,
                         prompt_tokens=len(self.req.tokens), error=error)

    def result(self, finish: str) -> GenResult:
        if finish in ("stop", "length") and not self.stopped_by_text:
            self.detok.finalize()
            text, hit = self.stops.feed(self.detok.last_segment)
            self.out(text)
            if hit:
                finish = "stop"
            else:
                self.out(self.stops.flush())
        if finish in ("stop", "length") and not self.stopped_by_text:
            # a grammar (sampling.GrammarMask) decides: "length" when it closed the answer against the model's own
            # choice to fit max_tokens (it parses, but the model did not end it, as OpenAI reports an answer
            # max_tokens ended); "stop" when max_tokens came as the model made the answer whole
            for p in self.procs:
                if callable(getattr(p, "finish", None)):
                    finish = p.finish(self.last, finish)
        return self.so_far(finish)
