"""The `slow` mark is enforced (tests/slowguard.py): an unmarked test that starts a rank, sshd, a namespace,
mlx_lm.server or the demo fails, naming itself. These tests are themselves unmarked, on purpose."""

import subprocess
import sys

import pytest
import slowguard
from rankharness import RankCluster


def test_an_unmarked_test_that_starts_a_rank_fails_naming_itself(request):
    with pytest.raises(pytest.fail.Exception, match=f"{request.node.nodeid} starts a real rank .* not marked slow"):
        subprocess.run([sys.executable, "-m", "clusterctl.rank", "--help"], capture_output=True)


def test_the_rank_harness_refuses_before_writing_a_spec(request, tmp_path):
    c = RankCluster(tmp_path, tmp_path / "model", [4, 4])
    with pytest.raises(pytest.fail.Exception, match=f"{request.node.nodeid} starts 2 real rank"):
        c.start()
    assert c.procs == [] and not list(tmp_path.glob("spec-rank*"))


@pytest.mark.parametrize("argv, what", [
    ([sys.executable, "-m", "clusterctl.rank", "--spec", "s.json"], "a real rank"),
    (["python3", "-m", "mlx_lm.server", "--model", "m"], "mlx_lm.server"),
    (["/usr/sbin/sshd", "-D", "-e", "-f", "cfg"], "a real sshd"),
    (["ip", "netns", "exec", "ns", "/usr/sbin/sshd", "-D"], "a real sshd"),
    (["ip", "netns", "add", "ns1"], "a network namespace"),
    ([sys.executable, "-m", "clusterctl", "demo", "--json"], "the demo"),
    ([sys.executable, "-m", "clusterctl", "plan", "-c", "c.toml"], None),
    (["ip", "netns", "pids", "ns1"], None),
    (["ssh-keygen", "-q", "-t", "ed25519"], None),
    ("true", None),
])
def test_expensive_programs_are_told_by_their_argv(argv, what):
    got = slowguard._program(argv)
    assert (got is None) if what is None else got.startswith(what), got


@pytest.mark.slow
def test_a_marked_test_passes_the_guard():
    slowguard.require_slow("nothing at all")  # returns: this test carries the mark


class _Item:
    def __init__(self, *fixtures, slow=False):
        self.fixturenames = ["request", *fixtures]
        self.marks = [pytest.mark.slow.mark] if slow else []

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


def test_tests_of_the_rank_clusters_sshd_or_namespaces_are_marked_by_their_fixtures():
    """Collection adds `slow` to a test whose fixture closure holds them (before -m "not slow" deselects)."""
    items = [_Item("shared_clusters"), _Item("sshd"), _Item("netns_cluster", "tmp_path"), _Item("tmp_path"),
             _Item("sshd_factory", slow=True)]
    slowguard.mark_by_fixtures(items)
    assert [len(i.marks) for i in items] == [1, 1, 1, 0, 1]


def test_unmarked_tests_over_the_limit_are_listed_with_their_time():
    timings = [("a", 1.0, False), ("a", slowguard.LIMIT_S, False), ("b", 0.2, False), ("c", 60.0, True),
               ("d", 9.0, False)]
    assert slowguard.long_unmarked(timings) == ["d (9.0 s)", f"a ({1 + slowguard.LIMIT_S:.1f} s)"]
