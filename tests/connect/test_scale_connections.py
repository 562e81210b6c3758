"""Connections at scale against a real sshd: the open-file limit raised at start, connections in waves when it
still cannot cover every node, EMFILE said as such, known_hosts parsed once per command."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys

import pytest

from clusterctl.errors import ClusterctlError, HostUnreachable
from clusterctl.connect import fdlimit
from clusterctl.connect.nodes import Connector, close_all, handles
from clusterctl.protocol.nodeops import AliveRequest
from clusterctl.plan.inventory import Node

PY = sys.executable


def sshd_nodes(sshd, n: int) -> list[Node]:
    """``n`` nodes that are all the one sshd (each its own connection)."""
    return [Node(name=f"n{i}", host=sshd.host, port=sshd.port, user="root", identity_file=str(sshd.client_key),
                 python=PY) for i in range(n)]


def test_the_cli_raises_its_soft_limit_toward_the_hard_one():
    code = ("import resource, sys\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from clusterctl.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE), file=sys.stderr)\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    soft, hard = map(int, r.stderr.split()[-2:])
    want = fdlimit.CEILING if hard == resource.RLIM_INFINITY else min(hard, fdlimit.CEILING)
    assert soft == want and soft > 256, r.stderr


def test_raising_never_lowers_the_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fdlimit.raise_nofile(want=16) == (soft, hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


@pytest.mark.slow
def test_more_nodes_than_connections_run_in_waves_and_say_so_once(sshd, monkeypatch, capsys):
    slots = fdlimit.ConnectionSlots(limit=2)
    monkeypatch.setattr(fdlimit, "SLOTS", slots)
    most = []
    real = slots.acquire

    async def acquire(holder):
        await real(holder)
        most.append(len(slots))

    slots.acquire = acquire

    async def go():
        hs = handles(sshd_nodes(sshd, 5), Connector(known_hosts=sshd.known_hosts))
        try:
            first = await asyncio.gather(*(h.ask(AliveRequest()) for h in hs.values()))
            again = await asyncio.gather(*(h.ask(AliveRequest()) for h in hs.values()))
        finally:
            await close_all(hs)
        return first + again

    answers = asyncio.run(go())
    assert [a.status for a in answers] == [[]] * 10
    assert len(most) >= 5 and max(most) <= 2  # every node got its turn, never more than 2 at once
    assert capsys.readouterr().err.count("connecting in waves") == 1


@pytest.mark.slow
def test_too_many_open_files_is_not_an_unreachable_node(sshd, monkeypatch):
    from clusterctl.connect.sshnode import connect

    monkeypatch.setenv("USER", "root")  # getpass would open /etc/passwd, which fails first

    async def go():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:  # every descriptor taken, as by hundreds of other connections
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        try:
            await connect(sshd.target())
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with pytest.raises(ClusterctlError) as e:
        asyncio.run(go())
    assert not isinstance(e.value, HostUnreachable)
    assert "too many open files" in e.value.message and "node is up" not in (e.value.hint or "")
    assert "ulimit -n" in e.value.hint


@pytest.mark.slow
def test_known_hosts_is_parsed_once_for_every_connection(sshd, monkeypatch):
    import asyncssh.known_hosts

    from clusterctl.connect import sshnode

    monkeypatch.setattr(sshnode, "_KNOWN_HOSTS", {})
    loads = []
    real = asyncssh.known_hosts.SSHKnownHosts.load
    monkeypatch.setattr(asyncssh.known_hosts.SSHKnownHosts, "load",
                        lambda self, data: (loads.append(1), real(self, data))[1])

    async def go():
        hs = handles(sshd_nodes(sshd, 4), Connector(known_hosts=sshd.known_hosts))
        try:
            return await asyncio.gather(*(h.transport.run(["true"]) for h in hs.values()))
        finally:
            await close_all(hs)

    assert [r.returncode for r in asyncio.run(go())] == [0] * 4
    assert len(loads) == 1
