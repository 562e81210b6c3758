"""Admission on rank 0: what the served model allows a request (``Limits``: the planned context, the vocabulary,
how many bytes a prompt can have and still fit), and where a request is prepared (``Preparer``: chat template and
tokenizer, on the request's own HTTP thread, one at a time, within a time budget) so that no client's prompt ever
runs on the step loop or holds it past the ladder's deadlines.

Why a byte cap before tokenizing: no token stands for more bytes than the vocabulary's longest entry, so a prompt
over ``context`` times that many bytes cannot fit and is refused without being read; below it, tokenizing takes
a bounded time (about 5 µs per byte with mlx-lm's tokenizers on these machines) and releases the GIL for most of it.
Why a budget on templates: a chat template is a program (Jinja); rendering is bounded by line-tracing only the
template's own compiled code, which is interrupted past its deadline, and (inside one filter or operation, which
the tracer does not see) by the size caps of protocol/chattemplate.py, which transformers renders with here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from clusterctl.rank.api.wire import ApiError
from clusterctl.protocol.chattemplate import (BUDGET_S, BoundedEnvironment, BudgetExceeded, TemplateTooLarge,
                                            template_budget)
from clusterctl.modelfiles.folder import text_config

PREPARE_BUDGET_S = BUDGET_S  # chat template and tokenizer time a request may take
MIN_TOKEN_BYTES = 16  # the byte cap's floor per token (a tokenizer whose vocabulary cannot be read)


@dataclass(frozen=True)
class Limits:
    """What the served model and the plan allow one request."""

    context: int  # prompt + completion tokens of one request: the plan's per-slot context, or the model's own
    model_context: int  # the model's max_position_embeddings
    vocab: int  # the logits' width (top_k at or past it keeps every token)
    token_bytes: int  # the most bytes one token can stand for
    planned: bool = True  # the context is the plan's (say so in refusals)

    @property
    def prompt_bytes(self) -> int:
        """A prompt of more bytes than this holds more tokens than the context."""
        return self.context * self.token_bytes

    def describe(self) -> str:
        return (f"the deployment's planned context of {self.context} tokens per request" if self.planned
                else f"the model's context of {self.context} tokens")


def limits_for(config: dict, tokenizer, planned_context: int | None) -> Limits:
    text = text_config(config)
    v = text.get("max_position_embeddings")
    model_context = int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 4096
    vocab_words = _vocab(tokenizer)
    v = text.get("vocab_size")
    vocab = int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else max(len(vocab_words), 1)
    token_bytes = max([MIN_TOKEN_BYTES, *(len(w.encode("utf-8", "surrogatepass")) for w in vocab_words)])
    context = min(model_context, planned_context) if planned_context else model_context
    return Limits(context=context, model_context=model_context, vocab=vocab, token_bytes=token_bytes,
                  planned=bool(planned_context) and planned_context <= model_context)


def _vocab(tokenizer) -> list[str]:
    try:
        words = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a readable vocabulary: the floor applies
        return []
    return [w for w in words if isinstance(w, str)]


def use_template(tokenizer, template: str | None) -> None:
    """The operator's chat template (plan --chat-template) in place of the model's own."""
    if not template:
        return
    tokenizer._chat_template = None  # mlx-lm's own Python template of some models, which would win
    tokenizer._tokenizer.chat_template = template
    tokenizer.has_chat_template = True


def bound_templates() -> None:
    """transformers renders every chat template in a jinja2 ``ImmutableSandboxedEnvironment`` it builds per
    template (``chat_template_utils``); the bounded one of protocol/chattemplate.py takes its place, so what rank 0
    renders has the size caps plan checked the template against. A transformers that builds it elsewhere stops
    the rank here rather than serving unbounded templates."""
    from transformers.utils import chat_template_utils as ctu

    if not hasattr(ctu, "ImmutableSandboxedEnvironment") or not hasattr(ctu, "_compile_jinja_template"):
        raise RuntimeError("this transformers builds chat templates where clusterctl cannot bound them")
    if ctu.ImmutableSandboxedEnvironment is not BoundedEnvironment:
        ctu.ImmutableSandboxedEnvironment = BoundedEnvironment
        ctu._compile_jinja_template.cache_clear()


class Preparer:
    """Prepares requests (``ApiRequest.prepare``: the template and the tokenizer) on their HTTP threads, one at a time:
    a second thread in the tokenizer would only take cores and the GIL from the ranks' compute."""

    def __init__(self, tokenizer, *, budget_s: float = PREPARE_BUDGET_S, wait_s: float = 30.0):
        bound_templates()
        self.tokenizer = tokenizer
        self.budget_s, self.wait_s = budget_s, wait_s
        self._one = threading.Lock()

    def prepare(self, api_req):
        """The request's GenRequest (its echo and splitters put on it), or an ApiError: 503 when others held the
        tokenizer past ``wait_s``, 400 when its own preparation ran past the budget."""
        if not self._one.acquire(timeout=self.wait_s):
            raise ApiError(503, f"busy preparing other prompts for {self.wait_s:g} s", type="server_error",
                           retry_after=1)
        try:
            t0 = time.monotonic()
            try:
                with template_budget(self.budget_s):
                    prepared = api_req.prepare(self.tokenizer)
                api_req.echo, api_req.splitters = prepared.echo, prepared.splitters
                api_req.splitter = None if prepared.splitters is None else prepared.splitters()
                return prepared.req
            except BudgetExceeded:
                raise ApiError(400, f"rendering the chat template took over {self.budget_s:g} s",
                               code="prompt_budget_exceeded") from None
            except TemplateTooLarge as e:
                raise ApiError(400, f"rendering the chat template: {e.message}", code="prompt_budget_exceeded") \
                    from None
            except ApiError:
                raise
            except RecursionError:
                raise ApiError(400, "the messages nest too deeply for the chat template") from None
            except Exception as e:  # a template or tokenizer failure is the request's problem, not the rank's
                text = str(e).splitlines()[0] if str(e) else ""
                raise ApiError(400, f"cannot tokenize the request: {type(e).__name__}: {text}"[:300]) from None
            finally:
                api_req.prepare_s = time.monotonic() - t0
        finally:
            self._one.release()
