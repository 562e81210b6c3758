"""Structured output: OpenAI's ``response_format`` enforced by a token mask at the sampling rank (issue 31 d).

llguidance (docs/dependencies.md says why: measured against outlines-core and xgrammar) compiles a JSON schema,
or "any JSON object", into a matcher that gives, per step, the set of tokens that keep the answer valid. The mask
is computed on the CPU per row per step (median ~15 µs for SmolLM2's 49,152 tokens; 8 rows together, unpacked to
bool, ~0.1 ms) and applied with one MLX op. Keys come in the schema's ``properties`` order (as OpenAI's).
One factory per rank (compiler.py's: it compiles on worker threads, off the step loop, and the step loop computes
the masks of the constraints it handed over); its constraints are per request.

Interface (the rank's samplers integrate it; nothing here knows about batches or HTTP)::

    factory = GrammarFactory(tokenizer, vocab)        # once per rank: mlx-lm's TokenizerWrapper, the logits' width
    c = factory.compile(response_format, max_tokens)  # per request; GrammarRefused(one line) -> answer 400
    masks = factory.masks([c, None, ...])             # (rows, vocab) bool, None = an unconstrained row
    logits = apply_masks(logits, masks)               # one mx.where; then sample as usual
    c.advance(token)                                  # per row, with the sampled token
    c.done                                            # the answer is complete: end the row now (finish "stop",
                                                      # or "length" when c.closed_by_budget)
    c.accepting                                       # EOS is allowed now (the answer so far is valid)
    c.mask()                                          # one row: (vocab,) bool
    c.min_tokens                                      # the shortest answer (tokens), when max_tokens was given

``response_format``: ``{"type": "text"}`` -> None (no constraint); ``{"type": "json_object"}`` -> any JSON
object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. ``strict: true`` refuses a
schema using keywords llguidance does not implement (``uniqueItems``, ``not``, ``if``, ``contains``, unknown
formats, ...) but, unlike OpenAI, does not require its subset (every key required, ``additionalProperties:
false``); ``strict: false`` (OpenAI: best effort) ignores what is not implemented and enforces the rest, so such
an answer may break the ignored keywords. Either way the rest is enforced, unlike OpenAI's non-strict mode. JSON
is written compactly, with ``", "`` and ``": "`` separators and no other whitespace: a model cannot pad an answer
with blanks forever.

max_tokens: OpenAI and mlx-lm cut the answer at max_tokens, leaving invalid JSON with finish "length". Here a
constraint given ``max_tokens`` closes the JSON in time: in the last tokens it computes a short way to a
complete answer (a greedy, deterministic roll-out on a copy of the matcher that closes strings, arrays and objects
as soon as the schema allows, and otherwise takes the shortest allowed token) and, once that way needs the tokens
left, forces it token by token; a little before that (``SLACK``), outside strings, a token that opens content
(",", "{", "[") is allowed only when it is the way out's next token, since one such token can commit the answer to
a whole new item (``},`` then an object with required keys). The answer then parses and validates (it may be
shorter than the model meant); ``closed_by_budget`` (a forced token not the model's own choice: ``advance``) tells
the integrator to report "length" (``finish``). The model is free until the way out plus 8 tokens fills the budget (one
sampled token can lengthen the way out, e.g. ``[{`` opens two containers; past the margin the answer could be cut).
Reasoning before the answer (tools.py: free text closed by its end marker) is closed the same way: the roll-out
takes the end marker first (free text would accept closing characters forever) and never opens a block, and the
reasoning ends ``_slack`` tokens before the roll-out's shortest answer would need, so the answer after it is the
model's own for a while (closing the reasoning counts as closed by the budget). A complete answer that may go on
(parallel calls) ends, closed_by_budget false, when another item of twice the shortest answer's length no longer
fits: the budget keeps the model from starting a call it would have to cut. A grammar that accepts the empty
answer (free text: tool_choice "none") has nothing to close: max_tokens cuts it as any text.
A grammar whose shortest answer found (``min_tokens``) does not fit in max_tokens would be forced from its first
token and cut: admission refuses it (compiler.py, a 400 naming max_tokens).
The roll-out costs a few masks (~15 µs each) per step in the last ``2 * min_tokens + 8`` (at least 64) tokens
while the model strays from it, and is bounded on every schedule by ``rollout_steps`` masks: rank 0 chooses it at
admission from what the grammar's masks cost (20 ms of them, 16 to 512), and every rank applies it, so lockstep
ranks compute the same masks; where rank 0 alone samples (overlapped) a roll-out is also cut at 20 ms
(``Constraint.seconds``). Past the bound: no way out, and a cut answer. A roll-out that found none is tried again
only after 1, 2, 4, ... 32 tokens.

Cost bounds: a schema is refused above 64 KiB of JSON, and its compile is refused when the lexer's fuel passes
LEXER_FUEL (about 1,000 properties or enum values); admission (compiler.py) bounds the compile's CPU time and the
first masks' and checks the parser's limits before any compute. Compiled matchers are cached by schema (LRU, 128)
and each request gets a deep copy (~10 µs). Refusals are ``compiler.GrammarRefused`` (a ValueError with a
``Refusal`` kind).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from clusterctl.rank.grammar.refusal import GrammarRefused, Refusal
from clusterctl.rank.engine.rollout import TokenTables, agrees, think_ids, way_out

MAX_SCHEMA_BYTES = 64 * 1024
# the lexer's fuel at compile (llguidance's default: 1,000,000). A compile's cost grows faster than its fuel: 1,000
# optional properties (or enum values) take ~18,000 and ~0.1 s, 2,000 ~37,000 and 0.5-3 s; past the limit the
# compile stops in ~15 ms, where admission's CPU budget (compiler.py) would leave it running to its end
LEXER_FUEL = 20_000
CACHE_SIZE = 128
ROLLOUT_WINDOW = 64  # start checking the way out when this many tokens (or fewer) are left
MARGIN = 8  # force the way out this many tokens early: one sampled token may lengthen it (e.g. "[{" opens two)
SLACK = 16  # and this many (at least the shortest answer's length) before that, tokens that open content (",", "{",
# "[" outside a string) are allowed only as the way out's next token: one such token can commit the answer to a
# whole new item (``},`` then an object with required keys: a way out of 2 tokens became 15 with 12 left)
ROLLOUT_STEPS = 512  # a roll-out longer than this is given up (the answer may then be cut)
ROLLOUT_SECONDS = 0.02  # ... and one that takes longer (a hostile schema's masks can cost ms each)
MAX_BACKOFF = 32  # after a failed roll-out, the next waits 1, 2, 4, ... up to this many tokens (deterministic)

# JSON written compactly, with the separators models write by themselves
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())[:400]


class Constraint:
    """One request's grammar state. Made by :meth:`GrammarFactory.compile`; not shared between requests."""

    def __init__(self, factory: "GrammarFactory", matcher, max_tokens: int | None,
                 rollout_steps: int = ROLLOUT_STEPS):
        self._f = factory
        self._m = matcher
        # a roll-out's bounds: masks (the same on every rank: rank 0 chose it at admission from what one costs) and,
        # where one rank alone samples (``seconds``), time
        self.rollout_steps = max(1, min(int(rollout_steps), ROLLOUT_STEPS))
        self.seconds: float | None = factory.rollout_seconds
        self._backoff, self._wait = 0, 0  # after a failed roll-out: tokens to wait before the next one
        self.remaining = max_tokens  # tokens the answer may still take (None: no limit)
        self._way_out: list[int] | None = None  # the roll-out from the current state, when computed
        self.closed_by_budget = False  # the budget forced the end of the answer against the model's own choice
        self.closing: int | None = None  # the token the budget forces now to close what the model has open
        self._window = ROLLOUT_WINDOW
        self._narrow = False  # the next mask keeps openers only as the way out's next token (``narrow``)
        self._slack = SLACK
        self._str = 0  # where the text is: 0 outside any JSON string, 1 in one, 2 in one after a backslash
        self.min_tokens: int | None = None  # the shortest answer's length in tokens (known when max_tokens is)
        self._closed = False  # the last token closed an item (a marker, or text ending in '"', ']', '}' or '>')
        if max_tokens is not None and matcher.is_accepting():  # an answer that may be empty (free text, e.g.
            self.remaining = max_tokens = None  # tool_choice "none"): nothing to close; max_tokens cuts it as any text
        if max_tokens is not None:
            self._way_out = self._rollout(0, None)  # untimed: the same shortest answer on every rank
            self.min_tokens = len(self._way_out) or None
            self._slack = max(SLACK, len(self._way_out))
            # the way out of a deeper state may be longer than the shortest answer: look well before
            self._window = max(ROLLOUT_WINDOW, 2 * len(self._way_out) + MARGIN + self._slack)
            self._way_out = self._way_out or None  # none found: looked for again in the window

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The answer is complete: only EOS may follow (end the row without another step)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """EOS is allowed now: the text so far is a complete, valid answer."""
        return self._m.is_accepting()

    # -- per step ------------------------------------------------------------------------------------------------
    def forced(self) -> int | None:
        """The token the budget forces now, or None (the grammar's own mask applies, ``narrow``-ed near the end).
        ``closing`` says when it closes what the model had open (``advance`` then judges it)."""
        self._narrow, self.closing = False, None
        if self.remaining is None or self.remaining > self._window or self._m.is_stopped():
            return None
        if self._m.is_accepting():
            # after a whole item (a call, with parallel calls allowed): no new one unless twice the shortest answer
            # fits; ending here cuts nothing. Else (a top-level number: one more digit could be fine, a "." would
            # not) only in the last tokens, and that ends the number the model was writing
            if self._closed and self.remaining <= 2 * (self.min_tokens or 0) + MARGIN:
                return self._f.eos[0]
            if self.remaining > MARGIN:
                return None
            self.closing = self._f.eos[0]
            return self.closing
        if self._way_out is None:
            if self._wait > 0:  # the last roll-out failed: not every step (each costs up to rollout_steps masks)
                self._wait -= 1
                return None
            self._way_out = self._rollout(self._str, self.seconds)
            if not self._way_out:
                self._backoff = min(2 * self._backoff or 1, MAX_BACKOFF)
                self._wait, self._way_out = self._backoff, None
                return None
        # reasoning (the way out opens with its end marker) ends early enough to leave the answer after it room of
        # its own (``_slack`` tokens), not only the roll-out's shortest answer
        room = self._slack if self._way_out and self._way_out[0] == self._f._think[1] else 0
        if self._way_out and len(self._way_out) + MARGIN + room >= self.remaining:  # [] when none was found
            self.closing = self._way_out[0]
            return self.closing
        self._narrow = bool(self._way_out) and self._str == 0 \
            and self.remaining <= len(self._way_out) + MARGIN + self._slack
        return None

    def _rollout(self, state: int, seconds: float | None) -> list[int]:
        return self._f._rollout(self._m, state, steps=self.rollout_steps, seconds=seconds)

    def narrow(self, row: np.ndarray) -> None:
        """Near the end (``forced`` said so), outside a string: tokens that open content leave the grammar's
        mask ``row``, except the way out's next token, so the way out cannot grow past the budget."""
        if self._narrow:
            tok = self._way_out[0]
            row &= self._f.no_openers()
            row[tok >> 5] |= np.int32(np.uint32(1 << (tok & 31)).view(np.int32))

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's bitmask (int32 words, llguidance's layout) into ``row``."""
        tok = self.forced()
        if tok is None:
            self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
            self.narrow(row)
        else:
            row[:] = 0
            row[tok >> 5] = np.int32(np.uint32(1 << (tok & 31)).view(np.int32))

    def mask(self) -> mx.array:
        """The next token's mask, shape (vocab,), bool."""
        return self._f.masks([self])[0]

    def own_mask(self) -> mx.array:
        """The grammar's own mask now, (vocab,) bool: what the model may take if the budget forced nothing."""
        row = np.empty(self._f._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
        return mx.array(np.unpackbits(row.view(np.uint8), bitorder="little")[:self._f.vocab].view(np.bool_))

    def advance(self, token: int, preferred: int | None = None) -> None:
        """Consume the sampled token. A token outside the mask is a bug in the caller: RuntimeError. When the
        budget forced it to close the answer (``closing``), ``preferred`` is the model's own choice under the
        grammar's mask (its argmax; None: not known): only a different one closed what the model meant to go on
        with (``closed_by_budget``; the same token is the model's own end, whatever the budget)."""
        token = int(token)
        if self.closing is not None and not self._agrees(token, preferred):
            self.closed_by_budget = True
        self.closing = None
        # the way out stays valid while the model follows it; [] (none found) is looked for again next step
        self._way_out = self._way_out[1:] if self._way_out and self._way_out[0] == token else None
        if not self._m.consume_token(token):
            raise RuntimeError(f"grammar: token {token} refused: {_one_line(self._m.get_error())}")
        if self.remaining is not None:
            self.remaining -= 1
            tables = self._f.tables()
            self._str, self._closed = tables.scan(self._str, token), tables.closes(self._closed, token)

    def _agrees(self, token: int, preferred: int | None) -> bool:
        """rollout.agrees at this closing step (blanks are layout only after a closed item, never in reasoning)."""
        layout = self._str == 0 and self._closed and bool(self._way_out) and self._way_out[0] != self._f._think[1]
        return agrees(self._f.tables(), self._way_out or [], token, preferred, layout=layout,
                      eos=token in self._f.eos)

    def finish(self, finish: str) -> str:
        """The finish reason of an answer the schedule ended with ``finish`` (its last token consumed): "length"
        when the budget closed what the model had open; "stop" when max_tokens came as the model made it whole."""
        if finish == "stop" and self.closed_by_budget:
            return "length"
        if finish == "length" and self.remaining is not None and not self.closed_by_budget and self.whole:
            return "stop"
        return finish

    @property
    def whole(self) -> bool:
        """The answer so far is complete and nothing in it is open (a top-level number could take more digits)."""
        return self._m.is_accepting() and (self._m.is_stopped() or self._closed)


class GrammarFactory:
    """Per rank: the tokenizer's token table for llguidance (~0.7 s for 49k tokens, done once), a cache of
    compiled schemas, the executor that computes the masks of several rows in parallel, and (made on first use,
    ~1 s) the tables of the roll-out that closes an answer within max_tokens."""

    def __init__(self, tokenizer, vocab: int | None = None, *, threads: int | None = None):
        """``tokenizer``: mlx-lm's TokenizerWrapper (or a fast HF tokenizer); ``vocab``: the logits' width (a
        config's vocab_size may exceed the tokenizer's: the extra ids are never allowed); ``threads``: for the
        masks of several rows (llguidance's default: 80% of the cores)."""
        import llguidance
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper or the HF tokenizer
        n_tok = len(hf)
        self.vocab = int(vocab or n_tok)
        eos = sorted(set(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id]))
        # n_vocab = the logits' width: ids past the tokenizer's own are never allowed (no bytes)
        self.lltok = llguidance.hf.from_tokenizer(hf, n_vocab=max(self.vocab, n_tok), eos_token=eos)
        self.eos = eos
        self._words = (self.lltok.vocab_size + 31) // 32
        self._exec = llguidance.LLExecutor(num_threads=threads)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hf, self._tables = hf, None  # the roll-out's token tables, made when a budget first needs them
        self._think = think_ids(tokenizer)  # (opens, closes) reasoning: the roll-out never opens, closes first
        # the time bound of the roll-outs of the constraints it makes (None: only their step bound; Constraint.seconds).
        # The ranks of a lockstep pipeline all sample, so their masks must not depend on how fast each one is: they
        # run without it
        self.rollout_seconds: float | None = ROLLOUT_SECONDS

    # -- compile -------------------------------------------------------------------------------------------------
    def compile_request(self, grammar: dict, max_tokens: int | None = None,
                        rollout_steps: int | None = None) -> Constraint | None:
        """A rank's request grammar: ``{"response_format": ...}`` (``compile``) or ``{"lark": text}`` (a forced tool
        call's markup, tools.CallConstraint.lark)."""
        base = self.base(grammar)
        return None if base is None else self.constraint(base, max_tokens, rollout_steps or ROLLOUT_STEPS)

    def base(self, grammar: dict):
        """The compiled matcher of a request's grammar (cached; None: no constraint); GrammarRefused (one line)."""
        if "lark" in grammar:  # a forced call, a response_format after reasoning (tools.reasoned_json), or text
            # without the call marker (tool_choice "none", tools.no_call_lark)
            what = "response_format.json_schema.schema" if "response_format" in grammar else "the tool call's grammar"
            return self._lark(grammar["lark"], what)
        return self._schema(grammar.get("response_format"))

    def constraint(self, base, max_tokens: int | None = None, rollout_steps: int = ROLLOUT_STEPS) -> Constraint:
        """A fresh Constraint of a compiled matcher (its own copy: a base is shared by every request of it)."""
        return Constraint(self, base.deep_copy(), None if max_tokens is None else int(max_tokens), rollout_steps)

    def compile_lark(self, text: str, max_tokens: int | None = None, what: str = "the tool call's grammar") \
            -> Constraint:
        """An llguidance Lark grammar -> a fresh Constraint; ValueError (GrammarRefused: one line, naming ``what``)
        when it does not compile."""
        return self.constraint(self._lark(text, what), max_tokens)

    def _lark(self, text: str, what: str):
        import llguidance

        if not isinstance(text, str) or len(text) > MAX_SCHEMA_BYTES:
            raise GrammarRefused(Refusal.TOO_LARGE, f"{what} is too large")
        return self._cached("lark:" + text, lambda: self._matcher(
            llguidance, lambda: llguidance.LLMatcher.grammar_from_lark(text), what))

    def _cached(self, key: str, build):
        """The compiled matcher of ``key`` (built on a miss; least recently used out past CACHE_SIZE). Compiles
        run on several threads (compiler.py): the cache is locked, a build is not."""
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
                return base
        base = build()
        with self._lock:
            self._cache[key] = base
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return base

    def _matcher(self, llguidance, grammar, what: str):
        """A matcher of ``grammar()`` (llguidance's grammar text); GrammarRefused (one line) naming ``what``."""
        try:
            g = grammar()
        except (ValueError, TypeError) as e:
            raise GrammarRefused(Refusal.INVALID, f"{what}: {_one_line(e)}") from None
        limits = llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=LEXER_FUEL)
        m = llguidance.LLMatcher(self.lltok, g, log_level=0, limits=limits)
        if m.is_error():  # its cost if 4x the fuel builds it (no tokens: cheaper than a compile), else invalid
            more = llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=4 * LEXER_FUEL)
            kind = Refusal.INVALID if llguidance.LLMatcher.validate_grammar(g, limits=more) else Refusal.COMPILE_COST
            raise GrammarRefused(kind, f"{what}: {_one_line(m.get_error())}")
        return m

    def compile(self, response_format: dict | None, max_tokens: int | None = None) -> Constraint | None:
        """OpenAI's ``response_format`` -> a fresh Constraint (None for ``text`` or no format); with
        ``max_tokens`` (the request's budget) it closes the answer within it (see the module's docstring).
        ValueError (GrammarRefused: one line, fit for a 400) when the format or its schema is unsupported or
        invalid."""
        base = self._schema(response_format)
        return None if base is None else self.constraint(base, max_tokens)

    def _schema(self, response_format: dict | None):
        import llguidance

        found = _schema_of(response_format)
        if found is None:
            return None
        schema, strict = found
        try:
            key = json.dumps([schema, strict], sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarRefused(Refusal.INVALID,
                                 f"response_format.json_schema.schema is not JSON: {_one_line(e)}") from None
        if len(key) > MAX_SCHEMA_BYTES:
            raise GrammarRefused(Refusal.TOO_LARGE, f"response_format.json_schema.schema is too large ({len(key)} "
                                                    f"bytes; at most {MAX_SCHEMA_BYTES})")
        options = dict(_JSON_OPTIONS, lenient=not strict)
        return self._cached(key, lambda: self._matcher(
            llguidance, lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options),
            "response_format.json_schema.schema"))

    # -- masks ---------------------------------------------------------------------------------------------------
    def bitmasks(self, constraints: Sequence[Constraint | None]) -> np.ndarray:
        """(rows, words) int32 bitmasks; a None row allows every token. The grammar rows are computed in
        parallel by llguidance's executor (the GIL is released)."""
        bits = np.full((len(constraints), self._words), -1, dtype=np.int32)
        par = []
        for i, c in enumerate(constraints):
            if c is None:
                continue
            tok = c.forced()
            if tok is None:
                par.append((c, i))
            else:
                c.fill(bits[i])
        if par:
            self._exec.unsafe_compute_mask_ptr([(c._m, i) for c, i in par], bits.ctypes.data, self._words * 4,
                                               len(constraints))
            for c, i in par:
                c.narrow(bits[i])
        return bits

    def masks(self, constraints: Sequence[Constraint | None]) -> mx.array:
        """(rows, vocab) bool: the next token's mask of each row (None rows: all True)."""
        bits = self.bitmasks(constraints)
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab]
        return mx.array(unpacked.view(np.bool_))

    # -- the way out under a token budget (rollout.py) ---------------------------------------------------------------
    def tables(self) -> TokenTables:
        """The roll-out's token tables (made on first use, ~1 s for 49k tokens)."""
        if self._tables is None:
            self._tables = TokenTables(self._hf, self.lltok, self._words, self._think)
        return self._tables

    def no_openers(self) -> np.ndarray:
        """A bitmask (int32 words) of every token but those whose text holds ",", "{" or "[" (Constraint.narrow)."""
        return self.tables().no_openers

    def _rollout(self, matcher, state: int, *, steps: int = ROLLOUT_STEPS, seconds: float | None = None) -> list[int]:
        """rollout.way_out of ``matcher``'s state."""
        return way_out(self.tables(), matcher, self._words, state, steps, seconds)

def _schema_of(response_format: dict | None) -> tuple[Any, bool] | None:
    """(schema, strict) of OpenAI's ``response_format``; None for ``text`` or none; GrammarRefused INVALID (one
    line)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarRefused(Refusal.INVALID, "response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, True
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise GrammarRefused(Refusal.INVALID,
                                 "response_format.json_schema must be an object with a 'schema' object")
        return spec.get("schema", {}), bool(spec.get("strict", False))
    raise GrammarRefused(Refusal.INVALID, "response_format.type must be 'text', 'json_object' or 'json_schema', "
                                          f"not {kind!r}")


def json_schema(response_format: dict) -> dict:
    """The schema of a JSON ``response_format`` with its llguidance options (``x-guidance``), as a Lark grammar's
    ``%json`` takes it (tools.reasoned_json): the same answers as ``GrammarFactory.compile`` allows."""
    found = _schema_of(response_format)
    if found is None or not isinstance(found[0], dict):
        raise GrammarRefused(Refusal.INVALID, "response_format.json_schema.schema must be a JSON schema object")
    schema, strict = found
    return {**schema, "x-guidance": dict(_JSON_OPTIONS, lenient=not strict)}


def apply_masks(logits: mx.array, masks: mx.array) -> mx.array:
    """Disallowed tokens of each row to -inf: one ``mx.where``. ``logits`` (rows, vocab), ``masks`` (rows, vocab)
    bool as made by :meth:`GrammarFactory.masks` (or (vocab,) for one row, broadcast)."""
    return mx.where(masks, logits, mx.array(-mx.inf, dtype=logits.dtype))
