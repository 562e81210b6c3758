"""How the suite is shared out among pytest-xdist workers (scripts/test runs ``-n N --dist loadgroup``).

- A worker takes a whole test file at a time (its module-scoped clusters start once), as ``--dist loadfile``.
- Every file whose tests use the session's shared rank clusters (``shared_clusters``,
  tests/rank/conftest.py; found in the file's text, see ``uses_shared_clusters``) goes to one worker as
  one unit (group ``shared-clusters``), so those clusters start once per run rather than once in each worker.
- Longest first: the scheduler hands out the file (or group) with the largest expected cost next, so the last
  file to finish is a short one. The costs are seconds measured on 2 cores (``--durations``); a file not in the
  table counts 0.5 s per test. Keep the table's big entries roughly right when a file grows by minutes.

The hooks are registered by tests/conftest.py (``terminal_summary`` is called by its terminal summary); nothing here changes a run without xdist.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest

SHARED_GROUP = "shared-clusters"

# Seconds per file (or group): the sum of its tests' times in one run of the whole suite with 3 workers on this
# 2-core VM (2026-12-05, a loaded machine: relative costs are what matters), the 30 largest, rounded.
COST: dict[str, float] = {
    "tests/launch/test_launch_local.py": 650,
    "tests/launch/test_replan.py": 500,
    "tests/rank/test_architectures.py": 490,
    "tests/rank/test_rank_pipeline.py": 400,
    "shared-clusters": 420,  # with test_prompt_logprobs.py (its lm-eval run and a tensor-parallel cluster)
    "tests/cli/test_fuzz_cli.py": 250,
    "tests/launch/test_security.py": 240,
    "tests/sync/test_sync.py": 150,  # 380 before its beds planned in-process
    "tests/launch/test_launch_failure_logs.py": 180,
    "tests/rank/test_smollm2.py": 170,
    "tests/launch/test_launch_ssh.py": 170,
    "tests/test_fuzz.py": 160,
    "tests/rank/test_rank_failures.py": 150,
    "tests/rank/grammar/test_grammar.py": 140,
    "tests/test_fuzz_ids.py": 130,
    "tests/rank/api/test_api_tools.py": 110,
    "tests/front/test_front.py": 90,
    "tests/gguf/test_ggufimport.py": 90,
    "tests/rank/test_rank_serve.py": 90,
    "tests/launch/test_teardown.py": 80,
    "tests/plan/test_kv.py": 80,
    "tests/connect/test_transport.py": 80,
    "tests/launch/test_cancel_acks.py": 70,
    "tests/launch/test_launch_netns.py": 60,
    "tests/launch/test_status_watch.py": 60,
    "tests/plan/test_replan_matrix.py": 50,
    "tests/modelfiles/test_tinymodel.py": 50,
    "tests/launch/test_serving_defaults.py": 50,
    "tests/rank/engine/test_admission_parts.py": 50,
    "tests/test_fuzz_limits.py": 50,  # 140 before plan's batching probe kept its answer per class and args
    # new on 2026-12-06 (helpers' single-process runs on a loaded machine, scaled)
    "tests/launch/test_hubmodel.py": 200,
    "tests/supervise/test_supervise_detached.py": 150,
    "tests/rank/test_adapters.py": 120,
}
DEFAULT_PER_TEST = 0.5


def _dist(config) -> str | None:
    try:
        return config.getoption("dist")
    except ValueError:  # pytest-xdist not installed
        return None


_RANK_DIR = "tests/rank/"


def uses_shared_clusters(root, path: str) -> bool:
    """Does the test file at ``path`` (relative to ``root``) use the session's shared rank clusters? Read from its
    text, as the controller has no collected items: it names ``shared_clusters``, or it sits in
    tests/rank/ and takes that folder's ``cluster`` fixture (an argument ``cluster`` without a fixture of
    its own by that name)."""
    try:
        text = (root / path).read_text()
    except OSError:
        return False
    if re.search(r"\bshared_clusters\b", text):
        return True
    return path.startswith(_RANK_DIR) and re.search(r"def test_\w*\([^)]*\bcluster\b", text) is not None \
        and re.search(r"def cluster\(", text) is None


class _LongestFirst(OrderedDict):
    """The work queue of the scheduler below: ``popitem`` returns the unit with the largest expected cost."""

    def popitem(self, last: bool = True):
        scope = max(self, key=lambda s: COST.get(s, DEFAULT_PER_TEST * len(self[s])))
        return scope, self.pop(scope)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if _dist(config) != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FilesLongestFirst(LoadGroupScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = _LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)  # an xdist_group mark (pytest 9 drops its "@group": none here)
            if scope != nodeid:
                return scope
            path = nodeid.split("::", 1)[0]
            if path not in shared:
                shared[path] = uses_shared_clusters(config.rootpath, path)
            return SHARED_GROUP if shared[path] else path  # no group: the test's file

    shared: dict[str, bool] = {}

    return FilesLongestFirst(config, log)


# Lines a worker wants on the terminal (the fuzzers' case counts, tests/fuzzutil.py): a worker's own terminal is
# not shown, so it leaves them in ``config.workeroutput["terminal_lines"]`` and the controller prints them.
_WORKER_LINES: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("terminal_lines", []))


def terminal_summary(terminalreporter):
    for line in _WORKER_LINES:
        terminalreporter.write_line(line)
