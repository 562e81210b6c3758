"""Shared pieces of the fuzzers (tests/test_fuzz*.py): settings, JSON and byte mutators, case counting, and an
in-process CLI runner whose stdout and stderr encode like a real process's.

``CLUSTERCTL_FUZZ_EXAMPLES`` sets the examples per parser / command / machine (300 in the suite); more: deeper
(docs/testing.md, "Fuzzing").
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from clusterctl.errors import ClusterctlError

MAX_EXAMPLES = int(os.environ.get("CLUSTERCTL_FUZZ_EXAMPLES", "300"))  # per parser and variant source; more: deeper
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fuzz_settings(scale: float = 1.0, **kw) -> settings:
    """FUZZ with ``scale`` times the examples (at least 10): for fuzzers whose single case costs more."""
    return settings(FUZZ, max_examples=max(10, int(MAX_EXAMPLES * scale)), **kw)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
JSON_ANY = st.recursive(JSON_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                        max_leaves=12)


def byte_variants(sample: bytes):
    """Random bytes, truncations, one to eight flipped bytes, and a sample with junk appended."""
    n = len(sample)

    def flip(edits):
        b = bytearray(sample)
        for i, v in edits:
            b[i % n] = v
        return bytes(b)

    return st.one_of(
        st.binary(max_size=2 * n),
        st.integers(0, n).map(lambda k: sample[:k]),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 255)), min_size=1, max_size=8).map(flip),
        st.binary(min_size=1, max_size=64).map(lambda junk: sample + junk),
    )


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _replace(obj, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, head: _replace(obj[head], rest, value)}
    out = list(obj)
    out[head] = _replace(obj[head], rest, value)
    return out


@st.composite
def json_variants(draw, doc):
    """The document with one to three values (or whole subtrees) replaced, a key dropped or added."""
    out = doc
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(out))
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "replace":
            out = _replace(out, path, draw(JSON_ANY))
        elif action == "drop" and path:
            parent = path[:-1]
            node = out
            for p in parent:
                node = node[p]
            if isinstance(node, dict):
                out = _replace(out, parent, {k: v for k, v in node.items() if k != path[-1]})
        elif action == "add":
            node = out
            for p in path:
                node = node[p]
            if isinstance(node, dict):
                out = _replace(out, path, {**node, draw(st.text(max_size=8)): draw(JSON_ANY)})
    return out


def write_file(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


# ---- case counting: how many cases ran per fuzzer (accepted / refused cleanly), printed after each module -------

CASES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # test -> outcome -> cases
_current = [""]


def set_current(name: str) -> None:
    _current[0] = name


def count(outcome: str) -> None:
    CASES[_current[0]][outcome] += 1


def report_cases(request, title: str) -> None:
    """Print (and forget) the counts gathered so far, on the terminal even under capture."""
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    worker_out = getattr(request.config, "workeroutput", None)
    if (tr is None and worker_out is None) or not CASES:
        CASES.clear()
        return
    lines = ["", f"{title} (CLUSTERCTL_FUZZ_EXAMPLES={MAX_EXAMPLES}):"]
    for name, c in CASES.items():
        parts = [f"{c['accepted']} accepted, {c['refused']} refused cleanly"] if {"accepted", "refused"} & set(c) \
            else []
        parts += [f"{c[k]} {k}" for k in sorted(c) if k not in ("accepted", "refused")]
        lines.append(f"  {name}: {sum(c.values())} cases ({', '.join(parts)})")
    CASES.clear()
    if worker_out is not None:  # an xdist worker's terminal is nobody's: the controller prints these at the end
        worker_out.setdefault("terminal_lines", []).extend(lines)
        return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for line in lines:
            tr.write_line(line)


def only_clean_errors(fn, *args):
    """Call a parser: a result or a ClusterctlError with a one-line message; anything else fails the test."""
    try:
        out = fn(*args)
    except ClusterctlError as e:
        assert e.message and "\n" not in e.message.strip(), repr(e.message)
        assert int(e.exit_code) in (1, 2, 65, 66, 69, 73, 75, 77, 78), e.exit_code
        count("refused")
        return None
    count("accepted")
    return out


# ---- the CLI in-process, with a real process's encodings ------------------------------------------------------

def cache_typer_command(mp) -> None:
    """Typer builds the click command tree of the app anew on every call (30 ms, 95% of a usage error's cost);
    the tree is the same each time: build it once per app (``mp``: a pytest MonkeyPatch)."""
    import typer

    cache = {}
    real = typer.main.get_command

    def cached(app):
        if id(app) not in cache:
            cache[id(app)] = (app, real(app))
        return cache[id(app)][1]

    mp.setattr(typer.main, "get_command", cached)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str
    stdout_error: str | None  # what writing stdout raised (a real process would have crashed there), or None


def run_cli(argv: list[str], env: dict | None = None) -> CliResult:
    """``clusterctl.cli.main(argv)`` in this process. stdout is UTF-8 strict and stderr UTF-8 backslashreplace,
    as in a real process under a UTF-8 locale: a lone surrogate (an undecodable argv byte) that reaches stdout
    fails here as it would there, instead of passing through a StringIO."""
    from clusterctl import cli

    out_b, err_b = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_b, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(err_b, encoding="utf-8", errors="backslashreplace", write_through=True)
    old_env = dict(os.environ)
    if env:
        os.environ.update(env)
    stdout_error = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(list(argv))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except UnicodeEncodeError as e:  # raised by our stdout outside the CLI's own handler
                stdout_error = repr(e)
                code = 70
            with contextlib.suppress(Exception):
                out.flush()
                err.flush()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    return CliResult(code, out_b.getvalue().decode("utf-8", "replace"),
                     err_b.getvalue().decode("utf-8", "replace"), stdout_error)


def json_documents(text: str) -> list:
    """Every JSON document in ``text``, in order (one pretty document, or JSON lines); ValueError if junk."""
    dec = json.JSONDecoder()
    docs, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return docs
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)


# ---- what every CLI run promises (docs/cli.md) -----------------------------------------------------------------

ECHO_LIMIT = 300  # characters of an overlong argument that may come back in a message
PATH_MAX = 4096  # an argument up to this long may be a real path, and may be echoed whole
STREAM_LIMIT = 1 << 20  # a plan of a 1,024-layer model is about 160 KB of JSON; a MB means an echo or a loop


def _period(value: str) -> str | None:
    for n in range(1, 8):
        if (value[:n] * (len(value) // n + 1))[:len(value)] == value:
            return value[:n]
    return None


def echoed(text: str, value: str) -> int:
    """How many characters of an overlong ``value`` come back in ``text`` in one piece (0 for a value that may
    be a real path). Exact for the periodic values the fuzzers make; for others, whether any of a few windows of
    ECHO_LIMIT+1 characters is there (then that many)."""
    if len(value) <= PATH_MAX:
        return 0
    unit = _period(value)
    if unit is None:
        n = ECHO_LIMIT + 1
        return n if any(value[i:i + n] in text for i in (0, len(value) // 2, len(value) - n)) else 0
    best = 0
    for i in range(len(unit)):
        rot = unit[i:] + unit[:i]
        for m in re.finditer(f"(?:{re.escape(rot)})+", text):
            best = max(best, m.end() - m.start())
    return best


_SEE_HELP = re.compile(r"\s*\(see [^()]*--help\)\s*$")


def cli_problems(r: CliResult, argv: list[str], values: list[str], why_usage: list[str]) -> list[str]:
    """Every broken promise of one CLI run (docs/cli.md), as short strings (empty: all kept). ``values``: the
    fuzzed values (none may come back longer than ECHO_LIMIT when longer than PATH_MAX); ``why_usage``: reasons
    the run must be a usage error (exit 2)."""
    bad = []
    if r.code == 70 or "Traceback (most recent call last)" in r.stderr:
        last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1:] or [""]
        bad.append(f"exit {r.code} (internal error): {last[0][:200]}")
    if r.stdout_error:
        bad.append(f"stdout cannot encode what was written: {r.stdout_error[:200]}")
    for name, text in (("stdout", r.stdout), ("stderr", r.stderr)):
        if len(text) > STREAM_LIMIT:
            bad.append(f"{name} is {len(text)} characters long")
        for v in values:
            n = echoed(text, v)
            if n > ECHO_LIMIT:
                bad.append(f"{name} echoes {n} characters of a {len(v)}-character argument")
                break
    if r.code not in (0, 3):
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        if not errors:
            bad.append(f"exit {r.code} without an 'error: ' line on stderr")
        elif not _SEE_HELP.sub("", errors[0][len("error:"):]).strip():
            bad.append(f"the error says nothing: {errors[0][:120]!r}")
        if "--json" in argv:
            try:
                docs = json_documents(r.stdout)
            except ValueError:
                docs = None
            if not docs or len(docs) != 1 or not isinstance(docs[0], dict) or docs[0].get("ok") is not False:
                bad.append(f"--json error: stdout is not one JSON document with ok false: {r.stdout[:120]!r}")
            elif docs[0].get("exit_code", r.code) != r.code:
                bad.append(f"--json error: exit_code {docs[0].get('exit_code')} but the exit is {r.code}")
        elif r.stdout.strip():
            bad.append(f"exit {r.code} printed on stdout (data only): {r.stdout.strip()[:80]!r}")
    if why_usage and r.code != 2:
        bad.append(f"exit {r.code}, not 2 (usage), for a value that is {why_usage[0]}")
    return bad




# ---- the CLI in a worker process: memory-capped, restarted when a case kills it ----------------------------------

class CliWorker:
    """A child Python (started once, single-threaded) that runs ``run_cli`` cases sent to it, under an address-space
    cap (RLIMIT_AS: what it maps after its imports plus ``extra_memory``). A value that makes a command allocate per
    layer or per token then fails fast there instead of swapping the machine, and an allocation failure in native
    code (pydantic-core aborts) ends the worker, not the test run: the case is reported and a new worker started.
    ``run`` returns ("ok", CliResult), ("died", how) or ("hung", seconds)."""

    def __init__(self, *, extra_memory: int = 1 << 30, warm: list[str] | None = None, timeout: float = 120.0):
        self.extra_memory, self.warm, self.timeout = extra_memory, warm, timeout
        self.proc = None

    def _start(self) -> None:
        import subprocess
        import sys

        code = ("import sys; sys.path.insert(0, %r); import fuzzutil; fuzzutil._worker_main(%d, %r)"
                % (str(Path(__file__).parent), self.extra_memory, self.warm))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self._read(self.timeout) != "ready":
            raise RuntimeError("the CLI worker did not start (its warm-up run failed?)")

    def _read(self, timeout: float):
        import pickle
        import select
        import struct

        out = self.proc.stdout
        if not select.select([out], [], [], timeout)[0]:
            return None  # no answer in time
        head = out.read(8)
        if len(head) < 8:
            return EOFError  # the worker is gone
        return pickle.loads(out.read(struct.unpack("<Q", head)[0]))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self) -> None:
        """Start the worker now if it is not running (its warm-up runs on the files as they are now)."""
        if not self.alive:
            self._start()

    def run(self, argv: list[str], env: dict | None = None, cwd: str | None = None):
        import pickle
        import signal
        import struct

        self.ensure()
        data = pickle.dumps((list(argv), dict(env or {}), cwd))
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        got = self._read(self.timeout)
        if got is not None and got is not EOFError:
            return "ok", got
        if got is None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return "hung", self.timeout
        rc = self.proc.wait()
        self.proc = None
        return "died", (signal.Signals(-rc).name if rc < 0 else f"exit {rc}")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(10)
            self.proc = None


def _worker_main(extra_memory: int, warm: list[str] | None) -> None:
    import pickle
    import resource
    import struct
    import sys

    import pytest

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever the CLI writes to fd 1 directly must not reach the protocol pipe
    out = os.fdopen(real_stdout, "wb")
    mp = pytest.MonkeyPatch()
    cache_typer_command(mp)
    if warm:
        run_cli(warm)  # the imports and first-use work of the command, before the cap
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + extra_memory if hard == resource.RLIM_INFINITY else min(mapped + extra_memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))

    def send(obj) -> None:
        data = pickle.dumps(obj)
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()

    send("ready")
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        argv, env, cwd = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        if cwd:
            os.chdir(cwd)
        send(run_cli(argv, env=env))


def counting_fixtures(title: str):
    """The two autouse fixtures of a fuzz module: each test's cases are counted under its name, and after the
    module the counts are printed under ``title``. Use: ``_count_cases, _report_cases = counting_fixtures(...)``."""
    import pytest

    @pytest.fixture(autouse=True)
    def _count_cases(request):
        set_current(request.node.name)
        yield

    @pytest.fixture(autouse=True, scope="module")
    def _report_cases(request):
        yield
        report_cases(request, title)

    return _count_cases, _report_cases
