"""The response side of tool calls and reasoning in rank 0's chat API: ``OutputSplitter`` turns detokenized
text into content, reasoning and tool-call events with mlx-lm's ``make_text_state_machine`` (the markers) and the
tokenizer's ``tool_parser`` (the call format), so no family has a parser here. The request side is tools.py.

Use, on rank 0::

    splitter = chat.splitter(tokenizer, tokens)     # tools.ChatTools: the request's splitter
    splitter.feed(piece) -> [Event]                 # each piece the rank emits (after its StopMatcher);
                                                    # stream: delta(event); splitter.should_stop: end the row
    splitter.finish(result.finish_reason)           # the rest, then Event("finish", reason)
    Reply().add(events).message()                   # non-stream: the OpenAI message

Decisions where OpenAI and mlx-lm leave room:
- Calls are parsed only when the request has tools (mlx_lm.server parses them always): a client that sent no
  tools gets the markup as text, not a ``tool_calls`` it cannot dispatch.
- A call that does not parse (cut by ``max_tokens`` or a stop string, or malformed JSON) never raises: its text,
  opening marker included, is returned as content (mlx_lm.server drops it silently) and ``malformed`` keeps it;
  under a forced call (``forced``: tool_choice "required" or a function) it is dropped (``malformed`` keeps it):
  the client asked for calls, and markup in its content is text it would show or parse as an answer.
- Whitespace right after a marker and right before one is dropped (``</think>\\n\\n`` and the newline between
  calls are the template's layout, not the answer); output without markers is passed through byte for byte.
- Text held back as a possible marker start is real text when generation ends: it is emitted on every finish
  reason (mlx_lm.server drops it on "stop"; its stop words sit in the same machine, ours do not).
- Stop strings are the rank's ``StopMatcher``'s, upstream: it feeds this splitter the text it lets through and its
  "stop" ends it. A stop string therefore stops inside reasoning or a call as well (the call is then malformed).
"""

from __future__ import annotations

import json
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional


class Event(NamedTuple):
    """One piece of a reply: ("content", str), ("reasoning", str), ("tool_call", call) with call
    {"index", "id", "type": "function", "function": {"name", "arguments": JSON text}}, or, last,
    ("finish", finish_reason)."""

    kind: str
    value: Any


def delta(event: Event) -> Optional[dict]:
    """The OpenAI stream ``delta`` of an event (None for "finish", which goes in the choice's finish_reason)."""
    if event.kind == "content":
        return {"content": event.value}
    if event.kind == "reasoning":
        return {"reasoning_content": event.value}
    if event.kind == "tool_call":
        return {"tool_calls": [event.value]}
    return None


class _WithoutCalls:
    """A tokenizer's markers with tool calling hidden, so its call markup stays text."""

    has_tool_calling = False

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


_MACHINES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _machine(tokenizer, parse_calls: bool):
    # built once per tokenizer (tries over the markers); a machine is shared, its runtime state is per reply.
    # mlx-lm is imported here: checking a request needs no MLX
    from mlx_lm.generate import make_text_state_machine

    try:
        per = _MACHINES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build one per reply
        per = {}
    if parse_calls not in per:
        per[parse_calls] = make_text_state_machine(tokenizer if parse_calls else _WithoutCalls(tokenizer))
    return per[parse_calls]


class OutputSplitter:
    """Splits a reply's detokenized text, fed piece by piece, into content, reasoning and tool-call events.

    ``feed(text)`` returns the events the text completes (a possible marker start is held back until known);
    ``finish(finish_reason)`` the rest, then ("finish", reason): "tool_calls" when a call was made and the
    reason was "stop" (or ``should_stop`` was set). Calls come out whole, each once, numbered from 0.
    """

    def __init__(self, tokenizer, tools: Optional[list[dict]] = None, *, parse_calls: Optional[bool] = None,
                 initial_state: str = "normal", parallel: bool = True, forced: bool = False):
        self._tokenizer = tokenizer
        self._tools = tools
        if parse_calls is None:
            parse_calls = bool(tools)
        self._parse_calls = parse_calls and tokenizer.has_tool_calling
        self._parallel = parallel
        self._forced = forced
        from mlx_lm.generate import TextStateMachine

        self._tsm = TextStateMachine
        self._sm = _machine(tokenizer, self._parse_calls).make_state(initial_state)
        self._state = initial_state
        self._fresh = initial_state != "normal"  # the prompt's marker opened this state
        self._held = ""  # trailing whitespace, dropped if a marker follows
        self._call_text = ""
        self.calls: list[dict] = []
        self.malformed: list[str] = []  # call texts that did not parse (returned as content)
        self.should_stop = False  # parallel_tool_calls false and a call is complete: end generation
        self.finish_reason: Optional[str] = None

    def feed(self, text: str) -> list[Event]:
        if not text or self.should_stop or self.finish_reason is not None:
            return []
        self._sm, segments = self._tsm.split(self._sm, text)
        out: list[Event] = []
        for i, (state, piece) in enumerate(segments):
            self._piece(state, piece, out)
            if i + 1 < len(segments):  # a marker ends this segment
                self._cross(segments[i + 1][0], out)
        return out

    def finish(self, finish_reason: str) -> list[Event]:
        if self.finish_reason is not None:
            return []
        out: list[Event] = []
        if not self.should_stop:
            # held as a possible marker start, but generation ended: it is text the model wrote
            self._sm, rest, state = self._tsm.flush(self._sm)
            self._piece(state, rest, out)
            if self._state == "tool" and self._parse_calls:
                self._close_call(out, closed=False)
            elif self._held and self._kind(self._state):
                out.append(Event(self._kind(self._state), self._held))
            self._held = ""
        # one call and the rest dropped (parallel_tool_calls false): the call made the answer, unless a forced call's
        # grammar said "length" (the budget closed what the model was still writing: mask.Constraint.finish)
        made = bool(self.calls) and (finish_reason == "stop" or (
            self.should_stop and not (self._forced and finish_reason == "length")))
        self.finish_reason = "tool_calls" if made else finish_reason
        out.append(Event("finish", self.finish_reason))
        return out

    def _kind(self, state: Optional[str]) -> Optional[str]:
        if state == "normal" or (state == "tool" and not self._parse_calls):
            return "content"
        return "reasoning" if state == "reasoning" else None  # other states (a format's headers) are not output

    def _piece(self, state: Optional[str], text: str, out: list[Event]) -> None:
        if not text or self.should_stop:
            return
        if state == "tool" and self._parse_calls:
            self._call_text += text
            return
        kind = self._kind(state)
        if kind is None:
            return
        if self._fresh:  # the layout after a marker
            text = text.lstrip()
            if not text:
                return
            self._fresh = False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            out.append(Event(kind, body))

    def _cross(self, new: Optional[str], out: list[Event]) -> None:
        if self._state == "tool" and self._parse_calls:
            self._close_call(out, closed=True)
        self._held = ""  # the layout before a marker
        self._fresh = True
        self._state = new

    def _close_call(self, out: list[Event], closed: bool) -> None:
        text, self._call_text = self._call_text, ""
        if self.should_stop:
            return
        calls = self._parse(text)
        if calls is None:
            self.malformed.append(text)
            if self._forced:
                return
            tok = self._tokenizer
            out.append(Event("content", tok.tool_call_start + text + ((tok.tool_call_end or "") if closed else "")))
            return
        for call in calls if self._parallel else calls[:1]:
            call["index"] = len(self.calls)
            self.calls.append(call)
            out.append(Event("tool_call", call))
        if not self._parallel:
            self.should_stop = True

    def _parse(self, text: str) -> Optional[list[dict]]:
        try:
            parsed = self._tokenizer.tool_parser(text, self._tools)
        except Exception:  # noqa: BLE001 - a parser failing on model output is a malformed call, not an error
            return None
        calls = []
        for p in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not p["name"]:
                return None
            args = p.get("arguments", {})
            if isinstance(args, str):  # already JSON text (a template that renders it so)
                try:
                    ok = isinstance(json.loads(args), dict)
                except ValueError:
                    ok = False
                text_args = args
            else:
                ok = isinstance(args, dict)
                text_args = json.dumps(args, ensure_ascii=False) if ok else ""
            if not ok:  # OpenAI's arguments are a JSON object; clients call f(**arguments)
                return None
            cid = p.get("id") if isinstance(p.get("id"), str) and p.get("id") else "call_" + secrets.token_hex(12)
            calls.append({"id": cid, "type": "function", "function": {"name": p["name"], "arguments": text_args}})
        return calls or None


@dataclass
class Reply:
    """A whole reply (the non-stream answer): what the events of one request add up to."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: Optional[str] = None

    def add(self, events: Iterable[Event]) -> "Reply":
        for e in events:
            if e.kind == "content":
                self.content += e.value
            elif e.kind == "reasoning":
                self.reasoning_content += e.value
            elif e.kind == "tool_call":
                self.tool_calls.append({k: v for k, v in e.value.items() if k != "index"})
            elif e.kind == "finish":
                self.finish_reason = e.value
        return self

    def message(self) -> dict:
        """The OpenAI ``message``: content None when the reply is only calls; keys without a value left out."""
        msg: dict[str, Any] = {"role": "assistant",
                               "content": None if self.tool_calls and not self.content else self.content}
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg
