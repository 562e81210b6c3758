"""The roll-out's token tables and walk (grammar/mask.py: the way out of an answer under a token budget): each token's
text, the roll-out's preferences among tokens, where a token leaves the text (in a JSON string or not; at the end
of an item or not), and the deterministic walk that finds a short way from a matcher's state to an accepted answer.
Made once per rank (~1 s for 49k tokens), when a budget first needs them."""

from __future__ import annotations

import time

import numpy as np

_OPENERS = set(",{[")  # outside a string, a token holding one can commit the answer to a whole new item
_CLOSERS = set('"]}')
_ENDS = ('"', "]", "}", ">")  # the last character of an item: a JSON value, a call's markup


class TokenTables:
    """The tokenizer's tokens as the roll-out sees them."""

    def __init__(self, hf, lltok, words: int, think: tuple[int | None, int | None]):
        """``hf``: the HF tokenizer; ``lltok``: llguidance's tokenizer of it; ``words``: a bitmask's int32 words;
        ``think``: the tokens that open and close a reasoning block (``think_ids``)."""
        self.texts: list[str] = hf.batch_decode([[i] for i in range(len(hf))])
        # a special token (a marker: "</think>", "<tool_call>") is never inside a JSON string: ``scan`` resets
        self.special = np.array([lltok.is_special_token(i) for i in range(len(self.texts))], dtype=bool)
        self.quotes = np.array(['"' in t or "\\" in t for t in self.texts], dtype=bool) | self.special
        orders = _orders(self.texts)
        opens, closes = think
        if closes is not None:  # free reasoning (TEXT) accepts closers forever: its way out is its end marker
            orders = tuple(np.concatenate([[closes], o[(o != closes) & (o != opens)]]) for o in orders)
        self.orders = orders
        keep = np.ones(words * 32, dtype=bool)
        keep[:len(self.texts)] = [not (_OPENERS & set(t)) for t in self.texts]
        # every token but those whose text holds ",", "{" or "[" (Constraint.narrow), as a bitmask
        self.no_openers = np.packbits(keep, bitorder="little").view(np.int32)

    def scan(self, state: int, token: int) -> int:
        """The string state (0 outside any JSON string, 1 in one, 2 in one after a backslash) after ``token``."""
        if token >= len(self.quotes) or (state != 2 and not self.quotes[token]):
            return state
        if self.special[token]:  # a marker ends whatever came before it (reasoning that quoted text)
            return 0
        for ch in self.texts[token]:
            if state == 2:
                state = 1
            elif state == 1:
                state = 2 if ch == "\\" else 0 if ch == '"' else 1
            elif ch == '"':
                state = 1
        return state

    def closes(self, closed: bool, token: int) -> bool:
        """Whether the text ends an item after ``token`` (``closed``: it did before; blanks keep it)."""
        if token >= len(self.texts):
            return closed
        body, special = self.texts[token].rstrip(), self.special[token]
        return bool(special or body[-1:] in _ENDS) if body or special else closed


def _orders(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The roll-out's preferences, outside a JSON string and inside one: first the tokens made only of closing
    characters, longest first (outside: not starting with a quote, which would open a string; inside: starting
    with the quote that ends it); then the others, shortest first (the least new content), ties by id; outside a
    string, blanks last (optional layout, e.g. around a marker, never closes anything)."""
    closer = np.array([bool(t) and set(t) <= _CLOSERS for t in texts], dtype=bool)
    quote = np.array([t[:1] == '"' for t in texts], dtype=bool)
    blank = np.array([bool(t) and not t.strip() for t in texts], dtype=bool)
    length = np.array([len(t) if t else 1 << 20 for t in texts])
    ids = np.arange(len(texts))
    outside, inside = closer & ~quote, closer & quote
    return (np.lexsort((ids, np.where(outside, -length, length), blank, ~outside)),
            np.lexsort((ids, np.where(inside, -length, length), ~inside)))


def way_out(t: TokenTables, matcher, words: int, state: int, steps: int, seconds: float | None) -> list[int]:
    """The tokens of a deterministic, short way from ``matcher``'s state (``state``: in a string or not) to an
    accepted answer; [] when none is found within ``steps`` masks (and ``seconds``, when given)."""
    m = matcher.deep_copy()
    row = np.empty(words, dtype=np.int32)
    way: list[int] = []
    n_tok = len(t.texts)
    repeats = 0
    deadline = time.perf_counter() + seconds if seconds is not None else None
    for _ in range(steps):
        if m.is_accepting():
            return way
        if deadline is not None and time.perf_counter() > deadline:
            return []
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:n_tok].view(np.bool_)
        order = t.orders[1 if state else 0]
        candidates = order[allowed[order]]
        if not len(candidates) or m.is_error():
            return []
        # the same token again and again may never end (e.g. "-0.000..." in a range): take the next one
        tok = int(candidates[min(max(repeats - 1, 0), len(candidates) - 1)])
        repeats = repeats + 1 if way and tok == way[-1] else 0
        if not m.consume_token(tok):
            return []
        way.append(tok)
        state = t.scan(state, tok)
    return []


def agrees(t: TokenTables, way: list[int], token: int, preferred: int | None, *, layout: bool, eos: bool) -> bool:
    """Whether the model's own choice ``preferred`` (its argmax under the grammar's mask; None: not known) went the
    way of the way out ``way`` whose first token ``token`` the budget forced: that token itself, a token whose text
    and the way out's agree as far as both go (the model writes "</tool" where the roll-out spells "<", "/", ...;
    its "is" after "Par" does not), or, where blanks are ``layout`` (before a marker), a blank. A forced ``eos``
    agrees only with itself."""
    if preferred is None:
        return False
    preferred = int(preferred)
    if preferred == token:
        return True
    if eos or preferred >= len(t.texts) or not way:
        return False
    text, mine = "".join(t.texts[i] for i in way), t.texts[preferred]
    if layout and mine and not mine.strip():
        return True
    return bool(mine) and (text.startswith(mine) or mine.startswith(text))


def think_ids(tokenizer) -> tuple[int | None, int | None]:
    """The tokens that open and close a reasoning block, when each is one token (mlx-lm's TokenizerWrapper knows
    them; a plain HF tokenizer: none)."""
    if not getattr(tokenizer, "has_thinking", False):
        return None, None
    ids = []
    for seq in (tokenizer.think_start_tokens, tokenizer.think_end_tokens):
        ids.append(seq[0] if seq is not None and len(seq) == 1 else None)
    return ids[0], ids[1]
