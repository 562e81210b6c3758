"""The fake transport as a parameter (connect/faketransport.py: ``FakeConnector``, a command's connector), and
a fake node that goes away and comes back (``ScriptedOps.cut``/``restore``), through the real node handles and op
sessions (connect/nodes.py, connect/opsession.py)."""

from __future__ import annotations

import asyncio

import pytest

from clusterctl.connect.faketransport import FakeTransport, ScriptedOps, fake_ssh
from clusterctl.connect.localnode import LocalTransport
from clusterctl.connect.nodes import Connector, close_all, handles
from clusterctl.connect.sshnode import SshTransport
from clusterctl.errors import HostUnreachable, RemoteCommandFailed
from clusterctl.plan.inventory import Node
from clusterctl.protocol.nodeops import MarkersRequest, ProbeRequest

A = Node(name="a", host="10.0.0.1", runtime_dir="/run/c")


def test_the_real_connector_is_the_default_and_the_fake_one_fakes_only_the_nodes_it_names():
    here = Node(name="here", host="localhost", runtime_dir="/run/c")
    real = handles([A, here], Connector())
    assert isinstance(real["a"].transport, SshTransport) and isinstance(real["here"].transport, LocalTransport)
    hs = handles([A, here], fake_ssh({"a": ScriptedOps()}))
    assert isinstance(hs["a"].transport, FakeTransport)
    assert isinstance(hs["here"].transport, LocalTransport) and here.is_local


def test_two_commands_at_once_each_talk_to_the_fake_they_were_given():
    """No global to patch: two sets of handles to the same node name, each answered by its own script."""
    one = ScriptedOps({"probe": lambda req: {"hostname": "one"}})
    two = ScriptedOps({"probe": lambda req: {"hostname": "two"}})

    async def go():
        h1, h2 = handles([A], fake_ssh({"a": one})), handles([A], fake_ssh({"a": two}))
        try:
            return await asyncio.gather(h1["a"].ask(ProbeRequest()), h2["a"].ask(ProbeRequest()))
        finally:
            await close_all(h1)
            await close_all(h2)

    assert [a.hostname for a in asyncio.run(go())] == ["one", "two"]
    assert (one.ops(), two.ops()) == (["probe"], ["probe"])


def test_a_node_cut_off_ends_its_sessions_refuses_new_ones_and_answers_again_once_restored():
    held = asyncio.Event()
    ops = ScriptedOps({"markers": lambda req: held.wait(), "probe": lambda req: {"hostname": "a"}})
    held_markers = MarkersRequest(runtime_dir="/run/c", job_id="j")

    async def go():
        hs = handles([A], fake_ssh({"a": ops}))
        h = hs["a"]
        try:
            assert (await h.ask(ProbeRequest())).hostname == "a"
            waiting = asyncio.ensure_future(h.ask(held_markers))
            await asyncio.sleep(0.01)
            ops.cut()
            with pytest.raises(RemoteCommandFailed, match="node operations failed"):
                await waiting  # the session it was asked on ended
            with pytest.raises(HostUnreachable, match="cannot reach a"):
                await h.ask(ProbeRequest())  # a new session is refused
            with pytest.raises(HostUnreachable):
                await h.transport.run(["true"])
            assert not ops.open_pipes
            ops.restore()
            assert (await h.ask(ProbeRequest())).hostname == "a"
            assert ops.sessions == 2  # the first one, and the one opened after the restore
        finally:
            await close_all(hs)

    asyncio.run(go())
