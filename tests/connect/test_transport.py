"""Transport: the same behaviour from LocalTransport and SshTransport, the latter against a real OpenSSH sshd.

The sshd runs on this machine, so a test can look at the "remote" processes and files directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from clusterctl.errors import (AuthRejected, CannotWrite, ClusterctlError, Exit, HostUnreachable, IntegrityError,
                               MissingInput, RemoteCommandFailed, UsageError)
from clusterctl.node import keeper
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.connect.nodes import make_transport
from clusterctl.connect.localnode import LocalTransport
from clusterctl.connect.transport import CommandTimedOut, Transport, shell_command_line

from fixtures_ssh import free_port, keygen, public_key

PY = sys.executable
NASTY = "sp ace; $(touch {c}) `touch {c}` 'sq' \"dq\" \\bs | & > < * ?\nnew line"


def arun(coro):
    return asyncio.run(coro)


def wait_group_dead(pgid: int, timeout: float) -> float:
    """Seconds until no live process is left in ``pgid``; fails after ``timeout``."""
    t0 = time.monotonic()
    while keeper.group_alive(pgid):
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"process group {pgid} still alive after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.slow)])
def make(request):
    """Build a fresh transport of either kind inside the running event loop."""
    if request.param == "local":
        return lambda **kw: LocalTransport(node="here", python=PY, **kw)
    sshd = request.getfixturevalue("sshd")
    return lambda **kw: make_transport("n1", local=False, target=sshd.target(), python=PY, **kw)


# ---------------------------------------------------------------------------------------------- run

def test_quoting_executes_nothing_and_uses_the_literal_path(make, tmp_path):
    canary = tmp_path / "canary"
    nasty = NASTY.format(c=canary)
    path = str(tmp_path / nasty.replace("/", "_"))

    async def go():
        t = make()
        try:
            assert isinstance(t, Transport)
            await t.run(["touch", path], check=True)
            echoed = await t.run(["printf", "%s", nasty])
            via_env = await t.run(["sh", "-c", 'printf %s "$V"'], env={"V": nasty, "W": "x"})
            listed = await t.run(["ls", str(tmp_path)])
            return echoed, via_env, listed
        finally:
            await t.close()

    echoed, via_env, listed = arun(go())
    assert Path(path).is_file()
    assert echoed.stdout.decode() == nasty and via_env.stdout.decode() == nasty
    assert not canary.exists(), "part of an argument was executed by a shell"
    assert sorted(os.listdir(tmp_path)) == sorted([Path(path).name])


def test_run_results_check_and_input(make):
    async def go():
        t = make()
        try:
            r = await t.run(["sh", "-c", "cat; echo err >&2; exit 3"], input=b"in\x00put")
            with pytest.raises(RemoteCommandFailed) as e:
                await t.run(["sh", "-c", "echo boom >&2; exit 4"], check=True)
            missing = await t.run(["/nonexistent/prog"])
            return r, e.value, missing
        finally:
            await t.close()

    r, err, missing = arun(go())
    assert (r.returncode, r.stdout, r.stderr_tail) == (3, b"in\x00put", "err")
    assert err.returncode == 4 and err.stderr_tail == "boom" and err.exit_code == Exit.FAILED
    assert err.argv[0] == "sh" and "boom" in err.message
    assert missing.returncode == 127


def test_run_timeout(make):
    async def go():
        t = make()
        try:
            t0 = time.monotonic()
            with pytest.raises(CommandTimedOut):
                await t.run(["sleep", "20"], timeout=0.5)
            return time.monotonic() - t0
        finally:
            await t.close()

    assert arun(go()) < 10


def test_bad_commands_are_refused_before_running():
    with pytest.raises(UsageError):
        shell_command_line(["echo", "a\0b"])
    with pytest.raises(UsageError):
        shell_command_line(["echo"], {"BAD NAME": "x"})
    with pytest.raises(UsageError):
        shell_command_line(["-x"], {"A": "1"})
    assert shell_command_line(["a b", "c"], {"K": "v w"}) == "env 'K=v w' 'a b' c"


# ---------------------------------------------------------------------------------------------- files

def test_write_file_is_atomic_and_read_file_is_careful(tmp_path):
    """A local node's files (a remote node's go through its op session: test_opsession.py)."""
    target = tmp_path / "d i r" / "f'il\"e;$(x)"
    target.parent.mkdir()
    target.write_bytes(b"old")
    held = open(target, "rb")  # a reader holding the old file keeps seeing the old contents
    (tmp_path / "big").write_bytes(b"x" * 5000)
    os.symlink(target, tmp_path / "link")
    payload = os.urandom(200_000)

    async def go():
        t = make_transport("local", local=True, target=None, python=PY)
        try:
            await t.write_file(str(target), payload, mode=0o600)
            got = await t.read_file(str(target), limit=300_000)
            errors = {}
            for name, path, limit in [("missing", tmp_path / "nope", 100), ("symlink", tmp_path / "link", 100),
                                      ("dir", tmp_path, 100), ("big", tmp_path / "big", 4999)]:
                try:
                    await t.read_file(str(path), limit=limit)
                except ClusterctlError as e:
                    errors[name] = e
            try:
                await t.write_file(str(tmp_path / "big" / "under-a-file"), b"x")
            except ClusterctlError as e:
                errors["write"] = e
            return got, errors
        finally:
            await t.close()

    got, errors = arun(go())
    assert got == payload and target.read_bytes() == payload
    assert held.read() == b"old"
    held.close()
    assert oct(target.stat().st_mode & 0o777) == "0o600"
    assert sorted(os.listdir(target.parent)) == [target.name], "a temp file was left behind"
    assert isinstance(errors["missing"], MissingInput)
    assert all(isinstance(errors[k], IntegrityError) for k in ("symlink", "dir", "big"))
    assert isinstance(errors["write"], CannotWrite)


# ---------------------------------------------------------------------------------------------- start + keeper

def test_start_reports_the_child_and_stops_it_when_stdin_closes(make):
    async def go():
        t = make(keeper_grace=30)
        try:
            sp = await t.start([PY, "-c", "import os,sys,time; print('ready', os.environ['X']); "
                                "sys.stderr.write('warming up\\n'); time.sleep(60)"], env={"X": "y z"})
            info = sp.info
            assert info.pid == info.pgid and os.getpgid(info.pid) == info.pgid != os.getpgid(0)
            assert info.start_time == psutil.Process(info.pid).create_time()
            assert info.boot_id == keeper.boot_id()
            for _ in range(100):
                if b"ready" in sp.stdout_tail and sp.stderr_tail:
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await sp.close_stdin()
            rc = await sp.wait()
            return sp, rc, time.monotonic() - t0
        finally:
            await t.close()

    sp, rc, took = arun(go())
    assert sp.stdout_tail == b"ready y z\n" and sp.stderr_tail == b"warming up\n"
    assert rc == 128 + signal.SIGTERM and took < 10  # well inside the 30 s grace
    assert not keeper.group_alive(sp.info.pgid)


def test_a_child_ignoring_sigterm_is_killed_after_the_grace(make):
    async def go():
        t = make()
        try:
            sp = await t.start(["sh", "-c", "trap '' TERM; echo up; sleep 60 & wait; sleep 60"], grace=1.0)
            while b"up" not in sp.stdout_tail:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            await sp.close_stdin()
            rc = await sp.wait()
            return sp, rc, time.monotonic() - t0
        finally:
            await t.close()

    sp, rc, took = arun(go())
    assert rc == 128 + signal.SIGKILL
    assert 1.0 <= took < 8
    assert not keeper.group_alive(sp.info.pgid)


@pytest.mark.slow
def test_kill_skips_the_grace(make):
    async def go():
        t = make()
        try:
            sp = await t.start(["sh", "-c", "trap '' TERM; sleep 60"], grace=30)
            t0 = time.monotonic()
            await sp.kill()
            took = time.monotonic() - t0
            # Already asked to stop (the keeper is inside its 30 s grace): kill() still ends it now.
            late = await t.start(["sh", "-c", "trap '' TERM; sleep 60"], grace=30)
            await late.close_stdin()
            t0 = time.monotonic()
            await late.kill()
            return sp, took, late, time.monotonic() - t0
        finally:
            await t.close()

    sp, took, late, late_took = arun(go())
    assert sp.returncode == late.returncode == 128 + signal.SIGKILL
    assert took < 10 and late_took < 10
    assert not keeper.group_alive(sp.info.pgid) and not keeper.group_alive(late.info.pgid)


@pytest.mark.slow
def test_exit_status_and_error_output_of_a_failing_child(make):
    async def go():
        t = make()
        try:
            sp = await t.start([PY, "-c", "import sys; print('x' * 100000); sys.exit('rank 1: out of memory')"])
            rc = await sp.wait()
            with pytest.raises(RemoteCommandFailed) as e:
                await t.start(["/nonexistent/rank"])
            return sp, rc, e.value
        finally:
            await t.close()

    sp, rc, err = arun(go())
    assert rc == 1 and sp.stderr_tail == b"rank 1: out of memory\n"
    assert len(sp.stdout_tail) == 65536 and sp.stdout_tail.endswith(b"x\n")
    assert err.returncode == 127 and "/nonexistent/rank" in err.message


def test_output_printed_before_the_keeper_report_is_kept_as_output(tmp_path):
    # A chatty shell rc file on a node prints before the keeper; the report must still be found.
    chatty = tmp_path / "chatty-python"
    chatty.write_text(f"#!/bin/sh\necho 'Welcome to node 7'\necho '{{not json'\nexec {PY} \"$@\"\n")
    chatty.chmod(0o755)

    async def go():
        t = LocalTransport(node="here", python=str(chatty))
        try:
            sp = await t.start(["sh", "-c", "echo child-out; exit 5"])
            return sp, await sp.wait()
        finally:
            await t.close()

    sp, rc = arun(go())
    assert rc == 5 and sp.info.pid > 0
    assert sp.stdout_tail == b"Welcome to node 7\n{not json\nchild-out\n"


@pytest.mark.slow
def test_closing_the_transport_stops_what_it_started(make):
    async def go():
        t = make(keeper_grace=3)
        sps = [await t.start(["sleep", "60"]) for _ in range(3)]
        await t.close()  # for SSH this closes the connection and with it every channel
        return [sp.info.pgid for sp in sps]

    for pgid in arun(go()):
        wait_group_dead(pgid, 3 + 5)


# ---------------------------------------------------------------------------------------------- ssh only

@pytest.mark.slow
def test_ssh_reuses_one_connection(sshd_factory):
    node = sshd_factory()

    async def go():
        t = make_transport("n", local=False, target=node.target(), python=PY)
        try:
            await asyncio.gather(*(t.run(["true"]) for _ in range(10)))
            sp = await t.start(["sleep", "30"])
            await t.run(["true"])
            await sp.kill()
        finally:
            await t.close()

    arun(go())
    assert node.log_text().count("Accepted publickey") == 1


@pytest.mark.slow
def test_unknown_host_key_is_refused_and_the_hint_works(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    target = sshd.target(known_hosts=kh)

    async def connect():
        t = make_transport("n1", local=False, target=target, python=PY)
        try:
            return await t.run(["echo", "in"])
        finally:
            await t.close()

    with pytest.raises(AuthRejected) as e:
        arun(connect())
    assert e.value.exit_code == Exit.NOPERM == 77
    assert sshd.host_spec in e.value.message and "not known" in e.value.message
    expected_fp = subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"], capture_output=True,
                                 text=True).stdout.split()[1]
    assert expected_fp in e.value.message
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {kh}" in e.value.hint
    assert not kh.exists(), "refusing must not record anything"
    # The command the hint gives really trusts the node.
    subprocess.run(f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {kh}", shell=True, check=True, capture_output=True)
    assert arun(connect()).stdout == b"in\n"


@pytest.mark.slow
def test_accept_new_stores_the_key_and_still_refuses_a_changed_one(sshd_factory, tmp_path):
    first, second = sshd_factory(), sshd_factory()
    kh = tmp_path / "known_hosts"

    async def connect(node, **kw):
        t = make_transport("n", local=False, target=node.target(known_hosts=kh, **kw), python=PY)
        try:
            return await t.run(["echo", "ok"])
        finally:
            await t.close()

    assert arun(connect(first, accept_new_host_keys=True)).stdout == b"ok\n"
    assert kh.read_text() == f"{first.host_spec} {public_key(first.host_key)}\n"
    assert arun(connect(first)).stdout == b"ok\n"  # strict checking now passes
    # The second node "was reinstalled": known_hosts remembers another key for its address.
    kh.write_text(kh.read_text() + f"{second.host_spec} {public_key(first.host_key)}\n")
    before = kh.read_text()
    with pytest.raises(AuthRejected) as e:
        arun(connect(second, accept_new_host_keys=True))
    assert e.value.exit_code == 77 and "CHANGED" in e.value.message and second.host_spec in e.value.message
    assert kh.read_text() == before


@pytest.mark.slow
def test_connection_refused_dns_and_auth_failures(sshd, tmp_path):
    wrong_key = keygen(tmp_path / "not_authorized")

    async def attempt(target: SshTarget):
        t = make_transport("n", local=False, target=target, python=PY)
        try:
            await t.run(["true"])
        finally:
            await t.close()

    with pytest.raises(HostUnreachable) as refused:
        arun(attempt(sshd.target(port=free_port())))
    assert refused.value.exit_code == Exit.UNAVAILABLE == 69 and "refused" in refused.value.message
    with pytest.raises(HostUnreachable) as dns:
        arun(attempt(sshd.target(host="no-such-node.invalid")))
    assert dns.value.exit_code == 69 and "no-such-node.invalid" in dns.value.message
    with pytest.raises(AuthRejected) as auth:
        arun(attempt(sshd.target(identity_file=wrong_key)))
    assert auth.value.exit_code == 77 and "authentication" in auth.value.message
    assert "Host key" not in auth.value.message


@pytest.mark.slow
def test_eight_nodes_run_concurrently(sshd_factory, tmp_path):
    """A barrier: every command waits until all 8 have started, so serial execution could never finish."""
    nodes = [sshd_factory() for _ in range(8)]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    script = 'touch "$1/$2"; while [ "$(ls "$1" | wc -l)" -lt 8 ]; do sleep 0.05; done; echo "$2"'

    async def go():
        ts = [make_transport(f"n{i}", local=False, target=n.target(), python=PY) for i, n in enumerate(nodes)]
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(*(t.run(["sh", "-c", script, "sh", str(barrier), str(i)], timeout=30,
                                                   check=True) for i, t in enumerate(ts)))
            return results, time.monotonic() - t0
        finally:
            await asyncio.gather(*(t.close() for t in ts))

    results, took = arun(go())
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    print(f"8 nodes, connect + barrier command: {took:.2f} s")


@pytest.mark.slow
def test_coordinator_closing_the_channel_stops_the_remote_group(sshd):
    grace = 1.0

    async def go():
        t = make_transport("n", local=False, target=sshd.target(), python=PY, keeper_grace=grace)
        try:
            sp = await t.start(["sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"])
            (await t.connection()).close()  # no EOF first: the channel just goes away
            with pytest.raises(HostUnreachable) as lost:
                await sp.wait()
            assert lost.value.exit_code == 69
            return sp.info.pgid, time.monotonic()
        finally:
            await t.close()

    pgid, closed_at = arun(go())
    wait_group_dead(pgid, grace + 8)
    print(f"remote group gone {time.monotonic() - closed_at:.2f} s after the channel closed (grace {grace} s)")


DRIVER = r"""
import asyncio, json, sys
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.connect.nodes import make_transport

async def main():
    t = make_transport("n", local=False, target=SshTarget.model_validate_json(sys.argv[1]), python=sys.executable,
                       keeper_grace=float(sys.argv[2]))
    sp = await t.start(["sh", "-c", "trap '' TERM; sleep 300"])
    print(sp.info.model_dump_json(), flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


@pytest.mark.slow
def test_sigkill_of_the_coordinator_kills_the_remote_child(sshd):
    grace = 1.0
    driver = subprocess.Popen([PY, "-c", DRIVER, sshd.target().model_dump_json(), str(grace)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line, driver.stderr.read()
        info = json.loads(line)
        assert keeper.group_alive(info["pgid"])
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        took = wait_group_dead(info["pgid"], grace + 8)
        print(f"remote child gone {took:.2f} s after SIGKILL of the coordinator (grace {grace} s)")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


NETNS_DRIVER = r"""
import asyncio, json, sys, time
from clusterctl.errors import ClusterctlError
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.connect.nodes import make_transport

def say(**kw):
    print(json.dumps(kw), flush=True)

async def main():
    targets = [SshTarget.model_validate_json(t) for t in json.loads(sys.argv[1])]
    ts = [make_transport(f"n{i}", local=False, target=t, python=sys.executable, keeper_grace=1.0)
          for i, t in enumerate(targets)]
    addrs = await asyncio.gather(*(t.run(["ip", "-4", "-o", "addr", "show", "eth0"], check=True) for t in ts))
    say(addrs=[a.stdout.decode() for a in addrs])
    ghost = targets[0].model_copy(update={"host": sys.argv[2], "connect_timeout": 1.5})
    t0 = time.monotonic()
    try:
        await make_transport("ghost", local=False, target=ghost, python=sys.executable).run(["true"])
        say(ghost="connected")
    except ClusterctlError as e:
        say(ghost=e.exit_code, message=e.message, took=time.monotonic() - t0)
    sp = await ts[0].start(["sh", "-c", "trap '' TERM; sleep 300"])
    say(started=sp.info.model_dump())
    sys.stdin.readline()  # the test cuts the link now
    t0 = time.monotonic()
    try:
        say(wait=await sp.wait())
    except ClusterctlError as e:
        say(wait=e.exit_code, message=e.message, took=time.monotonic() - t0)

asyncio.run(main())
"""


@pytest.mark.slow
def test_separate_hosts_in_namespaces_and_a_cut_link(netns_cluster):
    cluster = netns_cluster(2, sshd_extra="ClientAliveInterval 1\nClientAliveCountMax 1")
    targets = [n.target(keepalive_interval=1, keepalive_count_max=1).model_dump_json() for n in cluster.nodes]
    ghost_ip = cluster.coordinator_ip.rsplit(".", 1)[0] + ".250"
    driver = subprocess.Popen(cluster.exec_argv([PY, "-c", NETNS_DRIVER, json.dumps(targets), ghost_ip]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def read() -> dict:
            line = driver.stdout.readline()
            assert line, driver.stderr.read()
            return json.loads(line)

        addrs = read()["addrs"]
        for node, out in zip(cluster.nodes, addrs):
            assert f"inet {node.ip}/24" in out
        ghost = read()
        assert ghost["ghost"] == Exit.UNAVAILABLE, ghost
        info = read()["started"]
        assert keeper.group_alive(info["pgid"])
        cluster.cut(cluster.nodes[0])
        driver.stdin.write("go\n")
        driver.stdin.flush()
        lost = read()
        assert lost["wait"] == Exit.UNAVAILABLE and "lost the connection" in lost["message"], lost
        # On the node, sshd's ClientAlive check ends the session; the keeper sees EOF and stops its group.
        took = wait_group_dead(info["pgid"], 15)
        print(f"client noticed the cut in {lost['took']:.1f} s; node-side child gone {took:.1f} s later")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
