"""The node-op session (nodeops ``session`` + opsession.OpSession): one process per node answers every request of a
command, concurrently, over a local pipe and over a real sshd."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

from clusterctl.errors import CannotWrite, MissingInput, RemoteCommandFailed
from clusterctl.connect.nodes import NodeHandle
from clusterctl.connect.nodes import make_transport
from clusterctl.connect.localnode import LocalTransport
from clusterctl.connect.transport import CommandTimedOut
from clusterctl.plan.inventory import Node
from clusterctl.protocol.nodeops import (Answer, CleanAnswer, MarkersRequest, ProbeRequest, Request,
                                        WaitMarkersRequest, WatchedRank)

PY = sys.executable


class NoSuchOp(Request):
    """An op no node knows."""

    op: ClassVar[str] = "no_such_op"
    answer: ClassVar[type[Answer]] = Answer


class CleanWithoutFields(Request):
    """``clean`` as a coordinator that forgot its fields would send it."""

    op: ClassVar[str] = "clean"
    answer: ClassVar[type[Answer]] = CleanAnswer


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.slow)])
def handle(request):
    """A NodeHandle of either kind, built inside the running event loop; ``.root`` is the process the node's
    sessions descend from (this test process, or the sshd)."""
    if request.param == "local":
        def local():
            h = NodeHandle(Node(name="here", local=True), LocalTransport(node="here", python=PY))
            h.root = os.getpid()
            return h
        return local
    sshd = request.getfixturevalue("sshd")
    node = Node(name="n1", host="127.0.0.1", port=sshd.port)

    def remote():
        h = NodeHandle(node, make_transport("n1", local=False, target=sshd.target(), python=PY))
        h.root = sshd.proc.pid
        return h
    return remote


def sessions_under(root: int) -> int:
    """Node-op session processes descending from ``root`` (other tests' sessions elsewhere are not counted)."""
    import psutil

    n = 0
    for p in psutil.Process(root).children(recursive=True):
        try:
            n += (p.cmdline() or [])[-2:] == ["clusterctl.node.nodeops", "session"]
        except psutil.Error:
            pass  # ended meanwhile
    return n


def test_one_session_answers_concurrent_requests_in_any_order(handle, tmp_path):
    marker = tmp_path / "job-rank0.json"

    async def go():
        h = handle()
        try:
            before = sessions_under(h.root)
            slow = asyncio.ensure_future(h.wait_markers([str(marker)], {"serving"}, 5.0))
            await asyncio.sleep(0.3)
            # the long poll is still waiting; other requests on the same session answer meanwhile
            t0 = time.monotonic()
            await h.write_file(str(tmp_path / "sub" / "f.bin"), b"\x00\x01data", mode=0o600)
            assert await h.read_file(str(tmp_path / "sub" / "f.bin")) == b"\x00\x01data"
            probe = await h.ask(ProbeRequest())
            assert probe.hostname and time.monotonic() - t0 < 4.0
            assert not slow.done()
            assert sessions_under(h.root) - before == 1  # every request went through one process
            marker.write_text(json.dumps({"state": "serving", "rank": 0}))
            [doc] = (await slow).markers
            assert doc["state"] == "serving"
        finally:
            await h.close()
        assert oct((tmp_path / "sub" / "f.bin").stat().st_mode & 0o777) == "0o600"

    asyncio.run(go())


def test_errors_keep_their_kind_and_the_session_survives_them(handle, tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)

    async def go():
        h = handle()
        try:
            with pytest.raises(MissingInput, match="not found"):
                await h.read_file(str(tmp_path / "nope"))
            if os.geteuid() != 0:  # root writes anywhere
                with pytest.raises(CannotWrite):
                    await h.write_file(str(tmp_path / "ro" / "x"), b"x")
            with pytest.raises(RemoteCommandFailed, match="unknown op"):
                await h.ask(NoSuchOp())
            with pytest.raises(RemoteCommandFailed, match="clean failed"):
                await h.ask(CleanWithoutFields())  # a request missing its fields: the op's own error, one line
            with pytest.raises(CommandTimedOut):
                await h.ask(WaitMarkersRequest(paths=[str(tmp_path / "m.json")], states=["serving"], timeout=3),
                            timeout=0.3)
            assert (await h.ask(MarkersRequest(runtime_dir=str(tmp_path), job_id="j"))).markers == []
        finally:
            await h.close()

    asyncio.run(go())


def test_a_node_without_a_working_python_fails_every_request_with_its_reason(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'no module named clusterctl' >&2\nexit 1\n")
    fake.chmod(0o755)

    async def go():
        h = NodeHandle(Node(name="here", local=True), LocalTransport(node="here", python=str(fake)))
        try:
            with pytest.raises(RemoteCommandFailed, match="no module named clusterctl"):
                await h.ask(ProbeRequest())
        finally:
            await h.close()

    asyncio.run(go())


def test_the_session_answers_bad_lines_and_ends_at_eof():
    import subprocess

    lines = [{"id": 1, "op": "read", "req": {"path": "/proc/self/status", "limit": 1 << 20}}, "not json",
             {"id": 2, "op": "probe", "req": []}]
    p = subprocess.run([PY, "-m", "clusterctl.node.nodeops", "session"], timeout=60, capture_output=True,
                       input="".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode())
    assert p.returncode == 0
    answers = [json.loads(x) for x in p.stdout.splitlines()]
    by_id = {a["id"]: a for a in answers}
    assert "data" in by_id[1]["answer"]
    assert "bad request" in by_id[None]["error"] and "not a JSON object" in by_id[2]["error"]
    assert len(answers) == 3


def test_a_watched_process_that_is_gone_before_its_marker_is_ready_ends_the_wait_with_its_log(handle, tmp_path):
    """A detached rank has no keeper to wait on: the marker wait itself notices its process is gone (pid, start
    time and nonce checked) and answers at once with the last lines of its log."""
    import secrets
    import subprocess

    from launchutil import ident, spawn

    nonce = secrets.token_hex(8)
    log = tmp_path / "rank0.log"
    lines = [f"line {i}" for i in range(30)] + ["error: rank 0: cannot start"]
    dying = subprocess.Popen(["sh", "-c", f"sleep 0.5; printf '%s\\n' {' '.join(map(repr, lines))} >> {log}"],
                             env={**os.environ, "CLUSTERCTL_NONCE": nonce}, start_new_session=True)
    watch_dying = WatchedRank(**ident(dying, nonce), log_path=str(log))
    alive = spawn(nonce)
    watch_alive = WatchedRank(**ident(alive, nonce), log_path=str(tmp_path / "nothing.log"))
    marker = tmp_path / "job-rank0.json"
    marker.write_text(json.dumps({"state": "loading", "rank": 0}))
    ready = tmp_path / "job-rank1.json"
    ready.write_text(json.dumps({"state": "ready", "rank": 1}))

    async def go():
        h = handle()
        try:
            # the living process and the ready marker keep nobody from waiting: the wait runs to its timeout
            t0 = time.monotonic()
            ans = await h.wait_markers([str(marker)], {"ready"}, 1.0, watch=[watch_alive])
            assert ans.exited == [None] and time.monotonic() - t0 >= 1.0
            t0 = time.monotonic()
            ans = await h.wait_markers([str(ready), str(marker)], {"ready"}, 25.0, watch=[None, watch_dying])
            assert time.monotonic() - t0 < 15, "the wait ran on after the process was gone"
            assert ans.markers[1]["state"] == "loading" and ans.exited[0] is None
            assert ans.exited[1].log_tail == lines[-20:]
            # gone, but its marker says what was waited for: nothing to report
            marker.write_text(json.dumps({"state": "ready", "rank": 0}))
            ans = await h.wait_markers([str(marker)], {"ready"}, 5.0, watch=[watch_dying])
            assert ans.exited == [None] and ans.markers[0]["state"] == "ready"
        finally:
            await h.close()

    try:
        asyncio.run(go())
    finally:
        alive.kill()
        alive.wait()
        dying.wait()

