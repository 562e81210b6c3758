"""Why a request's grammar cannot be served: the typed refusal that compiler.py (at admission, off the step loop)
and grammar.py (when a schema does not compile) both raise, and the API answers as a 400 by its kind."""

from __future__ import annotations

import enum


class Refusal(enum.Enum):
    """Why a request's grammar is refused (a 400 at admission)."""

    INVALID = "invalid"  # not a format, not a schema, or keywords the grammar cannot enforce (strict)
    TOO_LARGE = "too_large"  # over grammar.MAX_SCHEMA_BYTES
    COMPILE_COST = "compile_cost"  # its compile ran past the lexer's fuel or the admission's CPU budget
    MASK_COST = "mask_cost"  # one of its first masks did (MASK_CPU_S)
    PARSER_LIMIT = "parser_limit"  # its mask allows a token its parser then refuses (llguidance's row/item limits)
    BUDGET = "budget"  # its shortest answer does not fit in the request's max_tokens (it could only be cut)


class GrammarRefused(ValueError):
    """A grammar that cannot be served: ``kind`` says why; the message (one line) is fit for a 400."""

    def __init__(self, kind: Refusal, message: str):
        super().__init__(message)
        self.kind = kind
