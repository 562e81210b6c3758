"""The `slow` mark, enforced: a test that starts something expensive without carrying it fails, naming itself.

`slow` means: starts real ranks, sshd, network namespaces, mlx_lm.server or model builds, or takes more than a
few seconds (pyproject.toml). `bash scripts/test -m "not slow"` is the inner loop and must stay fast, so the
mark cannot be left to memory:

- ``running(item)`` (``pytest_runtest_protocol`` below) records the test being run, from before its
  fixtures are set up to after they are torn down: a module or session fixture that starts ranks is set up inside
  the first test that asks for it, so the check below covers fixtures as well.
- ``require_slow(what)`` fails the running test unless it is marked. The helpers that start expensive things call
  it (tests/launch/rankharness.py ``RankCluster.start``, tests/fixtures_ssh.py ``start_sshd`` and ``NetnsBed``), and
  every process this test process starts is checked by its argv (``EXPENSIVE``): a rank, sshd, a namespace,
  mlx_lm.server, the demo, whoever starts them (a test, a helper, the launcher run in-process).
- What the argv cannot show (a fuzzer that runs for minutes, a launch run in a child process) shows in time:
  ``long_unmarked`` lists the unmarked tests that took longer than ``LIMIT_S`` at the end of the run.

Outside pytest (bench/ imports the helpers) nothing is running and nothing is checked.
"""

from __future__ import annotations

import os
import subprocess

import pytest

LIMIT_S = 5.0  # an unmarked test should take well under a second or two on an idle machine; 5 s leaves room for load

_running: pytest.Item | None = None
_original_popen_init = subprocess.Popen.__init__


def running(item: pytest.Item | None) -> None:
    global _running
    _running = item


def require_slow(what: str) -> None:
    """Fail the running test if it is not marked ``slow`` (it is about to start ``what``)."""
    item = _running
    if item is None or item.get_closest_marker("slow") is not None:
        return
    pytest.fail(f"{item.nodeid} starts {what} but is not marked slow: mark it (@pytest.mark.slow, or "
                "pytestmark = pytest.mark.slow for the file), see docs/testing.md", pytrace=False)


def _program(argv) -> str | None:
    """What an argv starts, if it is one of the expensive things; None for everything else."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = [argv]
    words = [os.fsdecode(a) for a in argv]
    if not words:
        return None
    if "clusterctl.rank" in words:
        return "a real rank (python -m clusterctl.rank)"
    if "mlx_lm.server" in words:
        return "mlx_lm.server"
    if any(os.path.basename(w) == "sshd" for w in words):
        return "a real sshd"
    if os.path.basename(words[0]) == "ip" and words[1:3] == ["netns", "add"]:
        return "a network namespace"
    if "clusterctl" in words and "demo" in words[words.index("clusterctl") + 1:words.index("clusterctl") + 2]:
        return "the demo (clusterctl demo)"
    return None


def _checked_popen_init(self, args, *rest, **kwargs):
    what = _program(args)
    if what is not None:
        require_slow(what)
    _original_popen_init(self, args, *rest, **kwargs)


def install() -> None:
    """Check every process this test process starts (subprocess.run, Popen and asyncio's subprocesses all go
    through ``subprocess.Popen.__init__``)."""
    subprocess.Popen.__init__ = _checked_popen_init


EXPENSIVE_FIXTURES = frozenset({"shared_clusters", "sshd_factory", "sshd", "netns_cluster"})


def mark_by_fixtures(items: list[pytest.Item]) -> None:
    """A test that asks (directly or through other fixtures) for the session's rank clusters, sshd or a namespace
    is slow whatever its file says; the guard above still catches every other way of starting them."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if EXPENSIVE_FIXTURES.intersection(names) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def long_unmarked(timings) -> list[str]:
    """``nodeid (N s)`` of every unmarked test whose phases (set-up, call, teardown) together took more than
    LIMIT_S; ``timings`` holds (nodeid, seconds, marked slow) of each phase."""
    total: dict[str, float] = {}
    for nodeid, seconds, slow in timings:
        if not slow:
            total[nodeid] = total.get(nodeid, 0.0) + seconds
    return [f"{nodeid} ({s:.1f} s)" for nodeid, s in sorted(total.items(), key=lambda kv: -kv[1]) if s > LIMIT_S]


# ---- the hooks (registered by tests/conftest.py, which imports them)

def pytest_configure(config):
    install()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_by_fixtures(items)  # before `-m "not slow"` deselects


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    running(item)  # from before the test's fixtures are set up to after they are torn down
    try:
        return (yield)
    finally:
        running(None)


TIMINGS: list[tuple[str, float, bool]] = []  # every phase's (nodeid, seconds, marked slow) seen by this process


def pytest_runtest_logreport(report):
    TIMINGS.append((report.nodeid, report.duration, "slow" in report.keywords))


def terminal_summary(terminalreporter) -> None:
    long = long_unmarked(TIMINGS)
    if long:
        terminalreporter.write_line(f"tests without the slow mark that took over {LIMIT_S:.0f} s "
                                    "(mark them slow or make them faster; docs/testing.md):", yellow=True)
        for line in long:
            terminalreporter.write_line(f"  {line}", yellow=True)
