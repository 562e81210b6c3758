"""What rank 0's OpenAI API answers, as typed models: ``ApiError`` (OpenAI's error shape), the sentences a request's
validation errors become (``said``, ``refuse``: requests.py's and messages.py's validators use them, requests.parse
puts the path of the value in), and the responses: ``Completion``, ``ChatCompletion`` and their stream chunks, dumped
with ``body()``: the same keys a client of OpenAI reads (``logprobs`` and ``finish_reason`` present as null;
``usage`` only where OpenAI puts it). The requests themselves: requests.py (docs/api.md lists their fields).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator
from pydantic_core import InitErrorDetails, PydanticCustomError

from clusterctl.protocol.httpedge import UNAUTHORIZED_CODE, UNAUTHORIZED_MESSAGE, error_document


RETRY_503_S = 2  # a 503 that names no time of its own (rank 0 loading or stopping): retry shortly


class ApiError(Exception):
    """A request that ends in an HTTP error, in OpenAI's shape (``body``); handler.py's ``error`` is the one place
    it becomes an answer (status, Retry-After, WWW-Authenticate, Connection). Every 503 has a ``retry_after``
    (docs/api.md): one made without it gets ``RETRY_503_S``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = RETRY_503_S if retry_after is None and status == 503 else retry_after

    def body(self) -> dict:
        return error_document(self.message, type=self.type, param=self.param, code=self.code)


UNAUTHORIZED = ApiError(401, UNAUTHORIZED_MESSAGE, code=UNAUTHORIZED_CODE)  # (the handler's and the routes')


# -- request errors as sentences: what requests.parse makes the 400 say, with the path of the value put in where
# they say {where}

SAID = "said"  # the type of an error whose text is ours


def sentence(text: str) -> PydanticCustomError:
    """An error whose text is ``text`` (``{where}`` in it: the path of the value, put in by requests.parse)."""
    return PydanticCustomError(SAID, "{text}", {"text": text})


def refuse(loc: tuple, text: str) -> ValidationError:
    """An error at ``loc`` (a path from the validator's own value): a rule between fields names the one at fault."""
    return ValidationError.from_exception_data("request", [InitErrorDetails(type=sentence(text), loc=loc,
                                                                            input=None)])


def said(text: str | Callable[[Any], str], *, whole: bool = False) -> WrapValidator:
    """This value's errors as one sentence (``text``, or ``text(value)``): every error of it (``whole``: a
    union, whose members' reports would say nothing to a client), else those of the value itself; an error
    inside one of its parts keeps its own, deeper, path and sentence."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            if whole or all(not err["loc"] for err in e.errors(include_url=False)):
                raise sentence(text(value) if callable(text) else text) from None
            raise
    return WrapValidator(check)


# -- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details={"cached_tokens": cached_tokens})


class _Choice(BaseModel):
    model_config = ConfigDict(extra="allow")  # token_ids (return_token_ids)

    index: int = 0
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatChoice(_Choice):
    message: dict[str, Any]


class ChatDelta(_Choice):
    delta: dict[str, Any]


class TextChoice(_Choice):
    text: str


class _Answer(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    usage: Optional[Usage] = None

    def body(self) -> dict:
        """The JSON document. ``usage`` is there when it was given, even as null (a stream's chunks carry
        ``"usage": null`` when the client asked for usage, and no key otherwise)."""
        return self.model_dump(exclude=None if "usage" in self.model_fields_set else {"usage"})


class ChatCompletion(_Answer):
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    choices: list[Union[ChatChoice, ChatDelta]]


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


