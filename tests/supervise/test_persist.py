"""Where the cluster serves (supervise/persist.py: Address), resolved once as the supervision starts: the flags,
else the state file a predecessor left, else the running job; a port nobody named is the first launch's."""

from __future__ import annotations

from types import SimpleNamespace

from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.statedir.healfile import SupervisorState
from clusterctl.supervise.persist import Address

RECORDED = SupervisorState(state="serving", deployment="d", http_host="10.0.0.1", http_port=27570)
RUNNING = SimpleNamespace(endpoint="http://[::1]:28000", http_port=28000)


def test_the_flags_win_then_the_state_file_then_the_running_job():
    assert Address.resolve(LaunchOptions(http_host="0.0.0.0", http_port=9000), RECORDED, RUNNING) == \
        Address("0.0.0.0", 9000)
    assert Address.resolve(LaunchOptions(http_host=""), RECORDED, RUNNING) == Address("10.0.0.1", 27570)
    assert Address.resolve(LaunchOptions(http_host=""), None, RUNNING) == Address("::1", 28000)
    assert Address.resolve(LaunchOptions(http_host=""), None, None) == Address("127.0.0.1", None)


def test_a_port_nobody_named_is_the_first_launchs_for_every_relaunch():
    a = Address("127.0.0.1", None).pinned(SimpleNamespace(http_port=27571))
    assert a == Address("127.0.0.1", 27571)
    assert a.pinned(SimpleNamespace(http_port=30000)) == a
