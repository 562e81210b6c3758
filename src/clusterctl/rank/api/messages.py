"""A chat request's parts as models (requests.py's ``ChatRequest`` holds them): ``messages``, a union on ``role``
(system or developer, user, assistant, tool, and any other role a template may know; content a string or a list of
text parts; only assistant messages make tool calls, a tool message names the call it answers), the ``tools`` (function
definitions), and the ``tool_choice`` among them. What a chat template gets of them is what the client wrote,
its other keys too, in their order (``as_dict``), with content as text and call arguments decoded."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      model_validator)

from clusterctl.rank.api.wire import SAID, refuse, said, sentence

MAX_NAME = 256  # characters of a function name (OpenAI: 64 of [a-zA-Z0-9_-]; mlx_lm.server: anything)
Plain = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # no string for a number; other keys allowed

# -- tools: function definitions, calls, and the choice among them


def _name(value: str) -> str:
    if not value or len(value) > MAX_NAME or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError("not a function name")
    return value


Name = Annotated[str, AfterValidator(_name),
                 said(f"{{where}} must be a function name: 1 to {MAX_NAME} printable characters, no spaces",
                      whole=True)]


class _Kept(BaseModel):
    """A part of a body that a chat template gets as the client wrote it: its other keys too, in their order."""

    model_config = Plain
    _keys: tuple = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _in_order(cls, data: Any, handler):
        part = handler(data)
        part._keys = tuple(data) if isinstance(data, dict) else ()
        return part

    def as_dict(self, **changes: Any) -> dict:
        """The part as the template gets it: ``dict(part, **changes)`` of what the client sent."""
        extra = self.__pydantic_extra__ or {}
        out = {k: getattr(self, k) if k in type(self).model_fields else extra[k] for k in self._keys}
        out.update(changes)
        return out


class FunctionDef(_Kept):
    name: Name
    description: Annotated[Optional[str], said("{where} must be a string", whole=True)] = None
    parameters: Annotated[Optional[dict[str, Any]], said("{where} must be a JSON schema object", whole=True)] = None
    strict: Annotated[Optional[bool], said("{where} must be a boolean", whole=True)] = None


class Tool(_Kept):
    type: Annotated[Literal["function"], said("{where}: only function tools are supported", whole=True)] = "function"
    function: Annotated[FunctionDef, said("{where} must be an object with a name")] = Field(None,
                                                                                            validate_default=True)

    def as_template(self) -> dict:
        return self.as_dict(type="function", function=self.function.as_dict())


TOOL_SHAPE = '{where} must be {"type": "function", "function": {...}}'


def _distinct(tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
    """No function defined twice; no tools ([]) is none, as in mlx_lm.server."""
    seen: set[str] = set()
    for i, t in enumerate(tools or ()):
        if t.function.name in seen:
            raise refuse((i, "function", "name"), f"{{where}}: {t.function.name!r} is defined twice")
        seen.add(t.function.name)
    return tools or None


Tools = Annotated[Optional[list[Annotated[Tool, said(TOOL_SHAPE)]]],
                  said('{where} must be a list of {"type": "function", "function": {...}}'), AfterValidator(_distinct)]


class _Named(BaseModel):
    model_config = Plain
    name: str


class NamedChoice(BaseModel):
    """tool_choice naming one function: that call is forced."""

    model_config = Plain
    type: Literal["function"]
    function: _Named


ToolChoice = Annotated[Union[Literal["none", "auto", "required"], NamedChoice],
                       said('{where} must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', whole=True)]


def _arguments(value: Any) -> Any:
    """A call's arguments as templates expect them: JSON text decoded (as mlx_lm.server does); "" means none."""
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise sentence("{where} is not valid JSON") from None
    raise sentence("{where} must be a JSON string")


class FunctionCall(_Kept):
    name: Name
    arguments: Annotated[Any, BeforeValidator(_arguments)] = Field(None, validate_default=True)


class ToolCall(_Kept):
    type: Annotated[Literal["function"], said('{where} must be "function"', whole=True)] = "function"
    id: Annotated[Optional[str], said("{where} must be a string", whole=True)] = None
    function: Annotated[FunctionCall, said("{where} must be an object with a name")] = Field(None,
                                                                                             validate_default=True)

    def as_template(self) -> dict:
        fn = self.function
        return self.as_dict(type="function", function=fn.as_dict(name=fn.name, arguments=fn.arguments))


# -- messages


class TextPart(_Kept):
    type: Literal["text"]
    text: str


def _content_said(value: Any) -> str:
    if isinstance(value, list):
        return "{where}: only text content parts are supported"
    return "{where} must be a string or a list of text parts"


Content = Annotated[Union[str, list[TextPart], None], said(_content_said, whole=True)]


class _Message(_Kept):
    role: str
    content: Content = None
    tool_calls: Annotated[None, said("{where}: only assistant messages make tool calls", whole=True)] = None

    def text(self) -> str:
        c = self.content
        return "" if c is None else c if isinstance(c, str) else "".join(p.text for p in c)


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: Annotated[Optional[list[Annotated[ToolCall, said(TOOL_SHAPE)]]],
                          said("{where} must be a list")] = None


def _filled(value: str) -> str:
    if not value:
        raise ValueError("empty")
    return value


# (a check, not min_length: pydantic's length constraints refuse a lone surrogate, which JSON and the rank allow)
CallId = Annotated[str, AfterValidator(_filled), said("{where} is required in a tool message", whole=True)]


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: CallId = Field(None, validate_default=True)
    name: Any = None  # the called function's, filled in from the call when the client leaves it out


class OtherMessage(_Message):
    """A role OpenAI does not define, passed on to the template (which may know it, as mlx_lm.server does)."""


ROLES = {"system": "system message", "developer": "system message", "user": "user message",
         "assistant": "assistant message", "tool": "tool message"}
TAGS = frozenset({*ROLES.values(), "other message"})  # where a message's path has its kind (not said in errors)


def _role(value: Any) -> Optional[str]:
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        return None
    return ROLES.get(value["role"], "other message")


Message = Annotated[Union[Annotated[SystemMessage, Tag("system message")], Annotated[UserMessage, Tag("user message")],
                          Annotated[AssistantMessage, Tag("assistant message")],
                          Annotated[ToolMessage, Tag("tool message")], Annotated[OtherMessage, Tag("other message")]],
                    Discriminator(_role, custom_error_type=SAID, custom_error_message="{text}",
                                  custom_error_context={"text": "{where} needs a role"})]
Messages = Annotated[list[Message], Field(min_length=1), said("{where} must be a non-empty list")]


def for_template(messages: list) -> list[dict]:
    """The messages as chat templates take them: content as text, assistant ``tool_calls`` with decoded
    arguments, ``tool`` messages with the called function's ``name`` when they have none; the client's other
    keys (``name``, ``reasoning_content``, ...) kept for templates that use them."""
    called: dict[str, str] = {}  # call id -> function name, for the tool messages that answer it
    out = []
    for m in messages:
        changes: dict[str, Any] = {"content": m.text()}
        if isinstance(m, AssistantMessage) and m.tool_calls is not None:
            changes["tool_calls"] = [c.as_template() for c in m.tool_calls]
            called.update((c.id, c.function.name) for c in m.tool_calls if c.id is not None)
        if isinstance(m, ToolMessage) and m.name is None and m.tool_call_id in called:
            changes["name"] = called[m.tool_call_id]
        out.append(m.as_dict(**changes))
    return out
