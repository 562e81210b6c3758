"""A process watched by a test or by the product is read once, never checked and then looked at (issue 49, item 1):
``psutil.pid_exists(p) and psutil.Process(p).status()`` raises ``NoSuchProcess`` when ``p`` exits between the two
reads, which is exactly what a test waiting for ``p`` to go is waiting for. tests/procstate.py reads once."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

from procstate import running, start_time

ROOT = Path(__file__).resolve().parents[1]


def _is_call(node: ast.AST, names: tuple[str, ...]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in names


def check_then_use(source: str) -> list[int]:
    """Lines of ``source`` where one expression (``and``/``or``, ``x if c else y``, an ``if`` or ``while`` test and its
    body's first statement) asks whether a pid exists and then opens the process."""
    out: list[int] = []
    if "pid_exists" not in source:
        return out
    for node in ast.walk(ast.parse(source)):
        parts: list[ast.AST] = []
        if isinstance(node, (ast.BoolOp, ast.IfExp)):
            parts = [node]
        elif isinstance(node, (ast.If, ast.While)):
            parts = [node.test, *node.body[:1]]
        nodes = [n for p in parts for n in ast.walk(p)]
        if any(_is_call(n, ("pid_exists",)) for n in nodes) and any(_is_call(n, ("Process",)) for n in nodes):
            out.append(node.lineno)
    return sorted(set(out))


def test_no_check_then_use_of_a_pid_in_the_tree():
    found = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        found += [f"{path.relative_to(ROOT)}:{n}" for n in check_then_use(path.read_text())]
    assert not found, "pid_exists then psutil.Process (use tests/procstate.py, or one read in a try):\n" + "\n".join(found)


def test_the_check_finds_the_forms_it_forbids():
    for bad in ("alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != Z]",
                "while psutil.pid_exists(pid) and psutil.Process(pid).status() != Z:\n    pass",
                "t = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else 1.0",
                "if psutil.pid_exists(pid):\n    proc = psutil.Process(pid)"):
        assert check_then_use(bad), bad
    for fine in ("alive = [p for p in alive if running(p)]", "ok = psutil.pid_exists(pid)",
                 "try:\n    psutil.Process(pid).status()\nexcept psutil.NoSuchProcess:\n    pass"):
        assert not check_then_use(fine), fine


def test_a_process_that_ends_reads_as_gone_not_as_an_error():
    assert start_time(2**22 + 7) is None and not running(2**22 + 7)  # above pid_max's default: never a process
    z = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    assert running(z.pid) and start_time(z.pid) is not None
    while running(z.pid):  # it ends as a zombie (not reaped yet): ended
        time.sleep(0.01)
    z.wait()
    assert not running(z.pid)  # reaped: gone (or, reused at once, someone else's: not this test's odds)
