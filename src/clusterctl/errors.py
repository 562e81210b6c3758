"""The one error root of clusterctl.

Every failure a user can cause or meet carries an exit code (after sysexits, see docs/cli.md) and a
one-line message; the CLI edge prints ``error: <message>`` (plus an optional hint) and exits with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # failed on at least one host (details in --json)
    USAGE = 2
    NOT_APPLIED = 3  # replan: previewed only (stdin is not a terminal and --yes was not given, or the answer was no)
    DATAERR = 65  # bad, tampered or unsigned deployment / manifest / contract
    NOINPUT = 66  # missing input file
    UNAVAILABLE = 69  # host unreachable
    SOFTWARE = 70  # internal error (the only one with a traceback)
    CANTCREAT = 73  # cannot write output
    TEMPFAIL = 75  # lock held, deployment busy
    NOPERM = 77  # authentication or host key rejected
    CONFIG = 78  # bad configuration, including "does not fit"


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f]} | {0x0a: "\\n", 0x0d: "\\r", 0x09: "\\t"}


MAX_MESSAGE = 2000  # characters of one error line; a longer one (a 1 MB value echoed) keeps its start and end
MAX_WORD = 240  # one run without spaces (a value echoed whole: a path, a name) is cut beyond this
_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD + 1))


def one_line(text: str) -> str:
    """A message as one printable line: control characters from files, keys or remote output (a newline, an
    escape sequence) are shown escaped, so nothing can break the line or drive the terminal; and cut to
    MAX_MESSAGE characters."""
    text = str(text).strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in text):
        text = text.translate(_CONTROL)
    if len(text) > MAX_WORD:
        text = _LONG_WORD.sub(lambda m: f"{m.group(0)[:120]}...({len(m.group(0))} characters)", text)
    if len(text) > MAX_MESSAGE:
        cut = len(text) - MAX_MESSAGE + 200
        text = f"{text[:MAX_MESSAGE - 400]} [... {cut} characters cut ...] {text[-200:]}"
    return text


def pydantic_line(e, default: str = "", *, plain: bool = False) -> str:
    """The first error of a pydantic ValidationError as ``field.path: message`` (values never echoed);
    ``default`` names a field-less error, ``plain`` drops pydantic's "Value error, " before a validator's text."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or default
    msg = first.get("msg", "invalid")
    return f"{where}: {msg.removeprefix('Value error, ') if plain else msg}"


class ClusterctlError(Exception):
    """Base error: a one-line message, an exit code and an optional hint."""

    exit_code: Exit = Exit.FAILED

    def __init__(self, message: str, *, hint: str | None = None, exit_code: Exit | None = None):
        message = one_line(message)
        super().__init__(message)
        self.message = message
        self.hint = one_line(hint) if hint is not None else None
        if exit_code is not None:
            self.exit_code = exit_code

    def to_json(self) -> dict:
        out = {"error": self.message, "exit_code": int(self.exit_code), "kind": type(self).__name__}
        if self.hint:
            out["hint"] = self.hint
        return out


class UsageError(ClusterctlError):
    exit_code = Exit.USAGE


class ConfigError(ClusterctlError):
    """A bad cluster.toml, model folder or flag combination, or a plan that does not fit."""

    exit_code = Exit.CONFIG


class DoesNotFit(ConfigError):
    def __init__(self, message: str, *, nodes: list[dict] | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.nodes = nodes or []


class IntegrityError(ClusterctlError):
    """A file that is corrupt, tampered with, unsigned, of a newer version, or of the wrong type. ``damaged``:
    truncated or garbled (not JSON, no signature block, not UTF-8), as opposed to well-formed but refused (a
    signature that does not verify, a newer version, another type): what the state dir moves aside."""

    exit_code = Exit.DATAERR

    def __init__(self, message: str, *, damaged: bool = False, **kw):
        super().__init__(message, **kw)
        self.damaged = damaged


class MissingInput(ClusterctlError):
    exit_code = Exit.NOINPUT


class CannotWrite(ClusterctlError):
    exit_code = Exit.CANTCREAT


class Busy(ClusterctlError):
    """A lock is held or the deployment is serving requests."""

    exit_code = Exit.TEMPFAIL


class HostUnreachable(ClusterctlError):
    exit_code = Exit.UNAVAILABLE

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.host = host


class AuthRejected(ClusterctlError):
    """Authentication failed or the host key is unknown / changed."""

    exit_code = Exit.NOPERM

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.host = host


class RemoteCommandFailed(ClusterctlError):
    """A command on a node exited non-zero; carries what is needed to understand it."""

    exit_code = Exit.FAILED

    def __init__(self, message: str, *, host: str, argv: list[str] | None = None,
                 returncode: int | None = None, stderr_tail: str = "", hint: str | None = None):
        super().__init__(message, hint=hint)
        self.host = host
        self.argv = argv or []
        self.returncode = returncode
        self.stderr_tail = stderr_tail

    def to_json(self) -> dict:
        out = super().to_json()
        out.update(host=self.host, argv=self.argv, returncode=self.returncode, stderr_tail=self.stderr_tail)
        return out


@dataclass(frozen=True)
class FailedRank:
    """A rank whose failure ended a launch: its marker said ``failed`` (``error``: why, None when it gave no
    reason), or it exited before it was ready (``stderr_tail``: its last lines; a detached rank's come from
    its log at ``log_path``)."""

    rank: int
    node: str
    error: str | None = None
    stderr_tail: str | None = None
    log_path: str | None = None

    def to_json(self) -> dict:
        if self.stderr_tail is None:
            return {"rank": self.rank, "node": self.node, "error": self.error}
        log = {"log_path": self.log_path} if self.log_path is not None else {}
        return {"rank": self.rank, "node": self.node, "stderr_tail": self.stderr_tail, **log}


class LaunchFailed(ClusterctlError):
    """A launch that did not reach ready; carries the ranks that failed and the report of the teardown of what
    it had started (the launch error is reported, and so is a teardown that could not confirm)."""

    exit_code = Exit.FAILED

    def __init__(self, message: str, *, ranks: list[FailedRank] | None = None, teardown=None,
                 hint: str | None = None, exit_code: Exit | None = None):
        super().__init__(message, hint=hint, exit_code=exit_code)
        self.ranks = ranks or []
        self.teardown = teardown  # a launch.teardown.TeardownReport, or None

    def to_json(self) -> dict:
        out = super().to_json()
        out["ranks"] = [r.to_json() for r in self.ranks]
        if self.teardown is not None:
            out["teardown"] = self.teardown.to_json()
        return out
