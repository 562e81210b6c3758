"""Chat templates are programs (Jinja) that operators and model files supply: the bounds they run under, on rank 0
and when plan, replan and model import check them.

- ``BoundedEnvironment``: jinja2's ``ImmutableSandboxedEnvironment`` (what transformers renders templates in)
  with a cap on the size of every value the template makes in one step: ``*`` and ``+`` of strings and lists,
  ``%`` formatting, ``**`` and ``*`` of integers, ``~`` concatenation, what ``{{ }}`` prints, the filters that
  join, pad, repeat or serialize (``join``, ``replace``, ``indent``, ``center``, ``format``, ``tojson``,
  ``string``, ...), and the string methods that do the same. The cap is checked before the value is made, so
  ``('x' * 300000000)|length`` is refused without its 286 MB and ``(['ab'] * 30000000)|join`` without its 25 s
  (time inside one operation is invisible to the line tracer below).
- ``template_budget``: the time budget; it line-traces only the template's compiled code and interrupts it past
  its deadline (loops of cheap steps).
- ``check_render``: one rendering of a sample conversation under both, as plan, replan and model import run it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import re
import sys
import time
import types
from datetime import datetime

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Characters (or list items) of one value a template makes. A request body is at most 4 MiB (rank/api/handler.py), so
# whatever a real template derives from one (its messages as JSON, escaped) fits with room.
MAX_VALUE = 1 << 24
MAX_INT_BITS = 1 << 16  # an integer past this many bits is no chat template's (and prints past Python's 4300 digits)
MAX_INDENT = 16  # tojson's indent
BUDGET_S = 10.0  # rank 0's time budget for preparing one request (rank/api/admission.py)
TEMPLATE_FILE = "<template>"  # the file name of Jinja's code compiled from a string (transformers' templates)

_DIGITS = re.compile(r"\d+")
# filters whose result can outgrow their input: checked before they run (the others only shrink or reorder)
_SERIALIZING = {"string", "pprint", "list", "sum", "urlencode", "xmlattr", "escape", "e", "forceescape"}


class TemplateTooLarge(Exception):
    """A template step would make a value past the cap. Not a jinja2 TemplateError: those are a request's
    messages refused by its template (rank/api/tools.py), this is the template's own excess."""

    def __init__(self, what: str, size: int, message: str | None = None):
        self.message = message or (f"the chat template would make {what} of {size:,} characters or items "
                                   f"(at most {MAX_VALUE:,})")
        super().__init__(self.message)
        self.what, self.size = what, size


def _size_argument(what: str, n: int) -> TemplateTooLarge:
    return TemplateTooLarge(what, n, f"the chat template asks {what} for a size of {n:,} (at most {MAX_VALUE:,})")


class BudgetExceeded(Exception):
    """The template ran past its time budget."""


def size_of(value, *, indent: int = 0, limit: int = MAX_VALUE) -> int:
    """About how many characters ``value`` takes printed (str() or JSON), counted until past ``limit``: a list
    holding one string a thousand times counts it a thousand times, as printing it does. Each element adds
    ``indent`` per level of nesting (JSON's pretty-printing). Costs at most about ``limit`` steps."""
    total = 0
    stack = [iter((value,))]
    while stack:
        v = next(stack[-1], _END)
        if v is _END:
            stack.pop()
            continue
        total += indent * len(stack)
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple)):
            total += 2 + len(v)
            stack.append(iter(v))
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack.append(itertools.chain.from_iterable(v.items()))
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() * 3 // 10 + 2
        else:
            total += 24
        if total > limit:
            return total
    return total


_END = object()


def _check(what: str, size: int) -> None:
    if size > MAX_VALUE:
        raise TemplateTooLarge(what, size)


def _ints(args, kwargs) -> list[int]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, int) and not isinstance(v, bool)]


def _check_format(fmt: str, args) -> None:
    """``fmt % args`` or ``fmt.format(*args)``: its widths and precisions (digits in it, or ``*`` taken from the
    arguments) and what it prints of the arguments."""
    widths = sum(int(d) for d in _DIGITS.findall(fmt) if len(d) < 12) + sum(abs(i) for i in _ints(args, {}))
    _check("a formatted string", len(fmt) + widths + size_of(args))


def _pre_filter(name: str, args: tuple, kwargs: dict) -> None:
    """Before a filter runs: what it would make, for the filters that can make more than they are given."""
    big = [abs(i) for i in _ints(args[1:], kwargs) if abs(i) > MAX_VALUE]
    if big:
        raise _size_argument(f"the filter {name}", big[0])
    value = args[0] if args else None
    if name == "join":
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        n = len(value) if hasattr(value, "__len__") else 0
        _check("a joined string", size_of(value) + n * len(str(sep)))
    elif name == "replace" and isinstance(value, str) and len(args) >= 3:
        _check("a replaced string", _replaced(value, str(args[1]), str(args[2])))
    elif name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else int(width) if isinstance(width, int) else 4
        _check("an indented string", len(value) + (value.count("\n") + 1) * pad)
    elif name == "wordwrap" and isinstance(value, str):
        width = args[1] if len(args) > 1 and isinstance(args[1], int) else 79
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring") or "\n"
        _check("a wrapped string", len(value) + (len(value) // max(width, 1) + 1) * len(str(wrap)))
    elif name == "format" and isinstance(value, str):
        _check_format(value, (*args[1:], *kwargs.values()))
    elif name == "tojson":
        indent = args[2] if len(args) > 2 else kwargs.get("indent")
        if isinstance(indent, str) or (isinstance(indent, int) and indent > MAX_INDENT):
            raise TemplateTooLarge("indented JSON", MAX_VALUE + 1,
                                   f"the chat template asks tojson for an indent of {indent!r} (at most {MAX_INDENT})")
        _check("JSON", size_of(value, indent=indent or 0))
    elif name in _SERIALIZING:
        _check(f"the result of {name}", size_of(value) * (6 if name in ("escape", "e", "forceescape", "xmlattr")
                                                          else 3 if name == "urlencode" else 1))


def _replaced(s: str, old: str, new: str) -> int:
    count = len(s) + 1 if not old else s.count(old)
    return len(s) + count * (len(new) - len(old))


def _post(what: str, value):
    """After a step: a string or list it made (its own length; what it holds was checked when made); a generator
    (map, select, batch, ...) counts what it yields, so joining or listing it cannot pass the cap either."""
    if isinstance(value, (str, list, tuple)):
        _check(what, len(value))
    elif isinstance(value, types.GeneratorType):
        return _counted(what, value)
    return value


def _counted(what: str, items):
    total = 0
    for item in items:
        total += len(item) + 1 if isinstance(item, (str, list, tuple)) else 1
        _check(what, total)
        yield item


def bounded_concat(parts) -> str:
    """Jinja's ``concat`` (a rendering, a macro's or a ``{% set %}`` block's output): a loop that prints a large
    value many times stops at the cap, not when the pieces are joined."""
    kept, total = [], 0
    for part in parts:
        total += len(part)
        _check("rendered text", total)
        kept.append(part)
    return "".join(kept)


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)  # keeps jinja2's pass_context / pass_eval_context markers
    def run(*args, **kwargs):
        # a filter that gets the context or environment first has its value second
        shift = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
        _pre_filter(name, args[shift:], kwargs)
        return _post(f"the result of {name}", fn(*args, **kwargs))

    run.bounded = True
    return run


def _pre_call(obj, args: tuple, kwargs: dict) -> None:
    """Before a call from template code: no size argument past the cap, and what the string methods that pad,
    join or replace would make."""
    big = [i for i in _ints(args, kwargs) if abs(i) > MAX_VALUE]
    if big:
        raise _size_argument(f"{getattr(obj, '__name__', 'a call')}()", abs(big[0]))
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox's str.format wrapper names the method it wraps
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "join" and args and hasattr(args[0], "__len__"):
        _check("a joined string", size_of(args[0]) + len(args[0]) * len(owner))
    elif name == "replace" and len(args) >= 2:
        _check("a replaced string", _replaced(owner, str(args[0]), str(args[1])))
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check("an expanded string", len(owner) + owner.count("\t") * (tab if isinstance(tab, int) else 8))
    elif name in ("format", "format_map"):
        _check_format(owner, (*args, *kwargs.values()))


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b ~ c``: the parts' size is checked before they are joined (one expression can repeat a large
    string thousands of times)."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.concat_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the size caps above (constructed as transformers constructs its own)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("finalize", _printed)
        super().__init__(*args, **kwargs)
        self.concat = bounded_concat
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs; no chat template uses it

    def from_string(self, source, globals=None, template_class=None):
        # the filters are wrapped here, after the caller set its own (transformers' tojson) and before the template
        # is compiled: jinja2 evaluates filters of constant arguments while compiling
        for name, fn in list(self.filters.items()):
            if not getattr(fn, "bounded", False):
                self.filters[name] = _bounded_filter(name, fn)
        return super().from_string(source, globals, template_class)

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    each = len(seq) if isinstance(seq, str) else size_of(seq)
                    _check("a repeated " + type(seq).__name__, each * max(n, 0))
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(abs(left).bit_length() + abs(right).bit_length())
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            _check_bits(abs(left).bit_length() * right)
        elif operator == "+" and isinstance(left, (str, list, tuple)) and hasattr(right, "__len__"):
            # lengths only (what the operands hold was checked when they were made): lists grow by + in loops
            _check("a " + type(left).__name__, len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        _pre_call(__obj, args, kwargs)
        return _post("the result of a call", super().call(__context, __obj, *args, **kwargs))

    def concat_parts(self, parts: tuple) -> tuple:
        _check("a concatenated string", size_of(parts))
        return parts


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateTooLarge("an integer", bits, f"the chat template would make an integer of {bits:,} bits "
                                                   f"(at most {MAX_INT_BITS:,})")


def _printed(value):
    """What ``{{ }}`` prints: a list or dict is printed whole."""
    if not isinstance(value, str):
        _check("printed text", size_of(value))
    return value


@contextlib.contextmanager
def template_budget(seconds: float):
    """Interrupt Jinja template code that runs past ``seconds`` (this thread only; other code runs untraced)."""
    deadline = time.monotonic() + seconds

    def local(frame, event, arg):
        if time.monotonic() > deadline:
            raise BudgetExceeded()
        return local

    def calls(frame, event, arg):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return local(frame, event, arg)
        return None

    old = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(old)


# ------------------------------------------------------------------------- the coordinator's checks

SAMPLE = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris."},
          {"role": "user", "content": "And of Italy?"}]


class Generation(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's part): its body, as
    transformers' AssistantTracker renders it when not tracking."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def environment() -> BoundedEnvironment:
    """The environment transformers renders chat templates in (its options, globals and ``tojson``), bounded."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(message)


def check_render(template: str, args: dict | None = None, *, budget_s: float = BUDGET_S) -> str | None:
    """Render ``template`` once for a short conversation (with a generation prompt), under rank 0's caps and time
    budget. Raises TemplateTooLarge or BudgetExceeded when it exceeds them. A template that refuses the sample
    (``raise_exception``, e.g. no system role) or fails on it otherwise is not refused here: it returns None."""
    try:
        with template_budget(budget_s):
            compiled = environment().from_string(template)
            return compiled.render(messages=SAMPLE, tools=None, documents=None, add_generation_prompt=True,
                                   **(args or {}))
    except (TemplateTooLarge, BudgetExceeded):
        raise
    except Exception:
        return None
