"""Run the real CLI entry (clusterctl.cli.main) in-process and capture what a shell would see."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def run(*args: str, env: dict | None = None) -> Result:
    from clusterctl import cli

    out, err = io.StringIO(), io.StringIO()
    old = dict(os.environ)
    if env:
        os.environ.update(env)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                cli.main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return Result(code, out.getvalue(), err.getvalue())


def run_process(*args: str, env: dict | None = None, timeout: float = 120, input: str | None = None) -> Result:
    """The CLI as a separate process (for signals, stdin that is not a terminal, import-time checks)."""
    e = dict(os.environ)
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, "-m", "clusterctl", *args], capture_output=True, text=True, env=e,
                       timeout=timeout, input=input if input is not None else "")
    return Result(p.returncode, p.stdout, p.stderr)
