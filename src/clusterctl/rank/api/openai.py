"""OpenAI request bodies (/v1/completions, /v1/chat/completions) checked and turned into ApiRequests
(requestqueue.py) whose tokenization runs next, on the request's HTTP thread (admission.py ``Preparer``), and
OpenAI's error shape (``ApiError``): what a client may ask, refused with a 4xx before it reaches the ranks."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading

from clusterctl.rank.engine.requestqueue import ApiRequest, Echo
from clusterctl.rank.choices import DEFAULT_MAX_N
from clusterctl.rank.engine.generation import GenRequest
from clusterctl.rank.api.wire import ApiError, ChatBody, CompletionBody, parse
from clusterctl.protocol.rankspec import RankSpec
from clusterctl.rank.api import tools as tl

BANNED = -1e9  # the logit bias of a token the request may never get (finite: it travels as JSON)
# fields OpenAI (or mlx_lm.server) defines that rank 0 cannot honour: refused (400, naming the field) rather than
# accepted and ignored; each with the value that asks for nothing
UNSUPPORTED = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "functions": (None,),
    "function_call": (None, "none"), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "xtc_probability": (None, 0, 0.0), "xtc_threshold": (None,), "num_draft_tokens": (None, 0), "adapters": (None,),
}


def _response_format(body: dict) -> dict | None:
    """OpenAI's response_format as the request's grammar (checked against the tokenizer when it is prepared)."""
    rf = body.get("response_format")
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    return {"response_format": rf}


def _reasoned(tokenizer, response_format: dict, tokens: list[int]) -> dict:
    """The grammar of a response_format on this model: the JSON after a reasoning block when the model reasons in
    one (mandatory when the prompt opened it, so that the answer is the content, not the reasoning), else the JSON
    alone."""
    if not tokenizer.has_thinking:
        return {"response_format": response_format}
    from clusterctl.rank.grammar.mask import json_schema  # grammar.py loads MLX and numpy; this module neither

    try:
        lark = tl.reasoned_json(tokenizer, json_schema(response_format), tl.initial_state(tokenizer, tokens))
    except ValueError as e:
        raise ApiError(400, str(e), param="response_format") from None
    return {"response_format": response_format} if lark is None else {"lark": lark, "response_format": response_format}


def refuse_unsupported(body: dict, honoured: tuple[str, ...] = ()) -> None:
    """A field that would change the answer but cannot be honoured is a 400 naming it, never silently ignored;
    ``honoured``: the ones this route answers (completions: echo)."""
    for name, fine in UNSUPPORTED.items():
        if name in honoured:
            continue
        if name in body and not any(body[name] == f and type(body[name]) is type(f) for f in fine):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(400, "only the text modality is supported", param="modalities")
# below this temperature a request is served greedy: 1/temperature overflows float32 near 1e-38 and the scaled
# logits become -inf or NaN (random tokens where a near-greedy answer was asked); the argmax is the limit anyway
GREEDY_BELOW = 1e-6


class RequestBuilder:
    """Turns an OpenAI request body into an ApiRequest whose ``prepare`` builds the GenRequest."""

    def __init__(self, spec: RankSpec, limits):
        self.spec = spec
        self.limits = limits  # admission.Limits of the served model and the plan
        self.context = limits.context
        self._count = 0
        self._lock = threading.Lock()

    def _seed(self, b: CompletionBody | ChatBody) -> int:
        if b.seed is not None:
            return b.seed + (1 << 64) if b.seed < 0 else b.seed  # one-to-one onto MLX's unsigned 64-bit seeds
        with self._lock:
            self._count += 1
            return (self.spec.seed * 1_000_003 + self._count) & 0x7FFFFFFF

    @staticmethod
    def _partition(b: CompletionBody | ChatBody, tenant: str | None) -> str:
        """The prompt-cache partition of a request: its caller's tenant and its cache_salt (promptcache.py)."""
        ident = json.dumps([tenant or "", b.cache_salt]).encode("utf-8", "surrogatepass")
        return hashlib.sha256(ident).hexdigest()[:32]

    @staticmethod
    def _logprobs(b: CompletionBody | ChatBody) -> int:
        """-1: none; else the alternatives per token (chat: logprobs true and top_logprobs; completions: the
        integer logprobs, as OpenAI's legacy API has it)."""
        if isinstance(b, ChatBody):
            if b.top_logprobs and not b.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (b.top_logprobs or 0) if b.logprobs else -1
        if b.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is for chat; /v1/completions takes an integer logprobs",
                           param="top_logprobs")
        return -1 if b.logprobs is None else b.logprobs

    def _n(self, b: CompletionBody | ChatBody) -> int:
        """How many choices (OpenAI's ``n``): 1 to the operator's limit (plan --max-n, else DEFAULT_MAX_N)."""
        limit = self.spec.serving.max_n or DEFAULT_MAX_N
        if b.n is not None and not 1 <= b.n <= limit:
            raise ApiError(400, f"n must be between 1 and {limit} on this deployment", param="n")
        return b.n or 1

    def _max_tokens(self, asked: int | None) -> int | None:
        """The request's max_tokens, else the operator's default, else None: until the context is full."""
        default = self.spec.serving.max_tokens or self.spec.max_tokens_default
        max_tokens = asked if asked is not None else default
        if max_tokens is not None and max_tokens >= self.context:  # a prompt holds one token at least
            if asked is None:
                return None  # the operator's default is past this plan's context: until it is full
            raise ApiError(400, f"max_tokens ({max_tokens}) leaves no room for a prompt in {self.limits.describe()}",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _common(self, body: dict, b: CompletionBody | ChatBody, tenant: str | None = None,
                honoured: tuple[str, ...] = ()) -> dict:
        refuse_unsupported(body, honoured)
        d = self.spec.serving  # the operator's defaults, else OpenAI's
        asked = b.max_completion_tokens if isinstance(b, ChatBody) and b.max_completion_tokens is not None \
            else b.max_tokens
        temperature = b.temperature if b.temperature is not None else (
            1.0 if d.temperature is None else d.temperature)
        top_k = b.top_k if b.top_k is not None else (d.top_k or 0)
        for k in ("repetition", "presence", "frequency"):
            size = getattr(b, f"{k}_context_size")
            if size is not None and size > self.context:
                raise ApiError(400, f"{k}_context_size must be between 1 and {self.context}",
                               param=f"{k}_context_size")
        return dict(
            max_tokens=self._max_tokens(asked),
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=b.top_p if b.top_p is not None else (1.0 if d.top_p is None else d.top_p),
            top_k=0 if top_k >= self.limits.vocab else top_k,  # k at or past the vocabulary keeps every token
            min_p=b.min_p if b.min_p is not None else (d.min_p or 0.0),
            repetition_penalty=b.repetition_penalty,
            presence_penalty=b.presence_penalty or 0.0,
            frequency_penalty=b.frequency_penalty or 0.0,
            **{f"{k}_context_size": getattr(b, f"{k}_context_size") or 20 for k in ("repetition", "presence",
                                                                                     "frequency")},
            logit_bias=self._logit_bias(b),
            seed=self._seed(b),
            stop=b.stops(),
            partition=self._partition(b, tenant),
            grammar=_response_format(body),
            logprobs=self._logprobs(b),
        )

    def _logit_bias(self, b: CompletionBody | ChatBody) -> dict[str, float] | None:
        """OpenAI's logit_bias: token id (a string, as JSON keys are) -> a bias in [-100, 100], at most 300."""
        out = {}
        for k, v in (b.logit_bias or {}).items():
            if not (k.isascii() and k.isdigit() and int(k) < self.limits.vocab):
                raise ApiError(400, f"logit_bias: {k[:20]!r} is not a token id of this model (0 to "
                                    f"{self.limits.vocab - 1})", param="logit_bias")
            out[str(int(k))] = float(v)
        return out or None

    def _request(self, rid: str, tokens: list[int], params: dict, tokenizer=None) -> GenRequest:
        """The request to generate: max_tokens resolved (none given: until the context is full) and checked (its
        grammar is compiled next, off the preparer's lock: Api.admit, compiler.py)."""
        max_tokens = params["max_tokens"] or max(self.context - len(tokens), 1)
        self._check_len(tokens, max_tokens)
        return GenRequest(id=rid, tokens=list(map(int, tokens)), **{**params, "max_tokens": max_tokens})

    def _check_len(self, tokens: list[int], max_tokens: int) -> None:
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        if len(tokens) + max_tokens > self.context:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds "
                                f"{self.limits.describe()}", code="context_length_exceeded")

    def _check_bytes(self, n: int) -> None:
        """Before any tokenizing: a prompt of more bytes than the context can hold tokens is refused unread."""
        if n > self.limits.prompt_bytes:
            raise ApiError(400, f"the prompt ({n} bytes) cannot fit {self.limits.describe()} (no token of this "
                                f"model stands for more than {self.limits.token_bytes} bytes)",
                           code="context_length_exceeded")

    def completion(self, body: dict, tenant: str | None = None) -> ApiRequest:
        b = parse(CompletionBody, body)
        prompt = b.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        elif not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        score_only = b.max_tokens == 0
        if score_only and not b.echo:
            raise ApiError(400, "max_tokens 0 makes nothing: it is for echo: true (score the prompt)",
                           param="max_tokens")
        if score_only:  # one token is made inside and dropped (Echo): every request ends in a step of the batch
            b = b.model_copy(update={"max_tokens": 1})
        params = self._common(body, b, tenant, honoured=("echo",))
        # echo with logprobs: the prompt's tokens are scored too (promptlogprobs.py), as many alternatives each
        params["prompt_logprobs"] = params["logprobs"] if b.echo else -1
        for name in ("chat_template_kwargs", "tools", "tool_choice"):
            if body.get(name) is not None:
                raise ApiError(400, f"{name} is for /v1/chat/completions", param=name)
        if isinstance(prompt, str):
            self._check_bytes(len(prompt.encode("utf-8", "surrogatepass")))
        elif len(prompt) + (params["max_tokens"] or 1) > self.context:
            self._check_len(prompt, params["max_tokens"] or 1)
        elif any(t < 0 or t >= self.limits.vocab for t in prompt):
            raise ApiError(400, "prompt has a token id outside the vocabulary", param="prompt")
        rid = "cmpl-" + secrets.token_hex(12)
        api_req = None

        def prepare(tokenizer) -> GenRequest:
            if isinstance(prompt, str):
                add = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
                tokens = tokenizer.encode(prompt, add_special_tokens=add)
            else:
                tokens = list(prompt)
            if b.echo:
                text = prompt if isinstance(prompt, str) else tokenizer.decode(tokens)
                api_req.echo = Echo(text=text, score_only=score_only)
            return self._request(rid, tokens, params, tokenizer)

        api_req = ApiRequest(id=rid, kind="completion", prepare=prepare, stream=bool(b.stream), n=self._n(b))
        return api_req

    def chat(self, body: dict, tenant: str | None = None) -> ApiRequest:
        """Messages (with tool calls and tool results), tools and tool_choice, the template's arguments: checked
        here (tools.py); rendered and tokenized by ``prepare`` on the request's HTTP thread."""

        b = parse(ChatBody, body)
        try:
            chat = tl.ChatTools.from_body(body)
        except tl.ToolsError as e:
            raise ApiError(400, str(e), param=e.param) from None
        params = self._common(body, b, tenant)
        if chat.choice in ("required", "function") and params["grammar"] is not None:
            raise ApiError(400, "a forced tool call (tool_choice required or a function) and a response_format "
                                "cannot both shape one answer", param="response_format")
        self._check_bytes(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "surrogatepass"))
                              for m in chat.messages))
        defaults = self.spec.serving.chat_template_args
        rid = "chatcmpl-" + secrets.token_hex(12)
        api_req = None

        def prepare(tokenizer) -> GenRequest:
            if not getattr(tokenizer, "has_chat_template", True):
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            # rendered, then measured, then tokenized (what tokenize=True does in one call): a template can make
            # far more text than the messages hold, and tokenizing it is the slow part
            try:
                text = tl.render(tokenizer, chat, defaults)
            except tl.ToolsError as e:
                raise ApiError(400, str(e), param=e.param) from None
            self._check_bytes(len(text.encode("utf-8", "surrogatepass")))
            tokens = tokenizer.encode(text, add_special_tokens=False)
            try:
                forced = chat.constraint(tokenizer, tokens)  # tool_choice required / a function: its grammar
            except tl.ToolsError as e:
                raise ApiError(400, str(e), param=e.param) from None
            if forced is not None:
                params["grammar"] = {"lark": forced.lark()}
            elif params["grammar"] is not None:  # response_format: after the reasoning, when the model reasons
                params["grammar"] = _reasoned(tokenizer, params["grammar"]["response_format"], tokens)
            elif (text := tl.no_call_lark(tokenizer, chat)) is not None:  # "none", a marker of several tokens
                params["grammar"] = {"lark": text}
            req = self._request(rid, tokens, params, tokenizer)
            banned = tl.banned_token_ids(tokenizer, chat)  # tool_choice "none": the call's opening token
            if banned:
                req.logit_bias = {**(req.logit_bias or {}), **{str(t): BANNED for t in banned}}
            api_req.splitters = lambda: chat.splitter(tokenizer, req.tokens)  # one per choice (choices.py)
            api_req.splitter = api_req.splitters()
            return req

        api_req = ApiRequest(id=rid, kind="chat", prepare=prepare, stream=bool(b.stream), n=self._n(b))
        return api_req

