"""One handle per node for the coordinator: its transport, its runtime dir, and the connector that opens them.

Every verb on a node is its transport's (connect/transport.py: run, start, node operations, its small files and
markers), the same for every kind of node; ``NodeHandle`` gives them for one node of a command, with its runtime dir
and its probe. Node operations go through one op session per node and command (connect/opsession.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from clusterctl.errors import ClusterctlError, ConfigError, Exit, UsageError, pydantic_line
from clusterctl.connect.localnode import LocalTransport
from clusterctl.connect.transport import NODEOP_TIMEOUT, Transport
from clusterctl.protocol.nodespec import Node
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.protocol.nodeops import Answer, ProbeAnswer, ProbeRequest, Request, WaitMarkersAnswer, WatchedRank


@dataclass
class Connector:
    """How a command reaches its nodes, a parameter of its own (each command's ``ssh``): it opens each node's
    transport. This one opens the real ones, LocalTransport for the coordinator's own node and SshTransport for
    the others, with the operator's SSH choices (flags; everything else comes from cluster.toml via ssh_policy);
    a test hands in a fake one instead (connect/faketransport.py: ``FakeConnector``)."""

    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0

    def transport(self, node: Node, *, keeper_grace: float = 10.0) -> Transport:
        return make_transport(node.name, local=node.is_local, target=ssh_target(node, self),
                              python=node_python(node), keeper_grace=keeper_grace)


def node_python(node: Node) -> str:
    # A local node runs the coordinator's own interpreter unless cluster.toml names another one.
    if node.is_local and node.python == "python3":
        return sys.executable
    return node.python


def ssh_target(node: Node, ssh: Connector):
    """The SshTarget of a remote node (None for a local one): the one source of its SSH options."""
    if node.is_local:
        return None
    from pydantic import ValidationError

    try:
        return SshTarget(host=node.host, port=node.port, user=node.user,
                         identity_file=Path(node.identity_file) if node.identity_file else None,
                         known_hosts=ssh.known_hosts, accept_new_host_keys=ssh.accept_new_host_keys,
                         connect_timeout=ssh.connect_timeout)
    except ValidationError as e:
        raise ConfigError(f"node {node.name}: {pydantic_line(e, 'ssh', plain=True)}") from None


def make_transport(node_name: str, *, local: bool, target, python: str, keeper_grace: float = 10.0) -> Transport:
    """LocalTransport for the coordinator's own node, SshTransport (lazily connected) for the others."""
    if local:
        return LocalTransport(node=node_name, python=python, keeper_grace=keeper_grace)
    if target is None:
        raise UsageError(f"node {node_name} is not local and has no ssh target")
    from clusterctl.connect.sshnode import SshTransport  # asyncssh is imported only when a node needs it

    return SshTransport(node_name, target, python=python, keeper_grace=keeper_grace)




@dataclass
class NodeHandle:
    """One node of a command: its transport (every verb on the node goes through it, the same for every kind of
    node: Transport), its runtime dir and what its probe said."""

    node: Node
    transport: Transport
    runtime_dir: str | None = None
    probe: ProbeAnswer | None = None

    @property
    def name(self) -> str:
        return self.node.name

    def path(self, name: str) -> str:
        assert self.runtime_dir, "runtime dir not resolved yet"
        return os.path.join(self.runtime_dir, name)

    # the transport's node verbs, for this node
    async def ask(self, req: Request, *, timeout: float = NODEOP_TIMEOUT, paced: bool = False) -> Answer:
        return await self.transport.ask(req, timeout=timeout, paced=paced)

    async def read_file(self, path: str, *, limit: int = 65536) -> bytes:
        return await self.transport.read_file(path, limit=limit)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        await self.transport.write_file(path, data, mode=mode)

    async def read_tail(self, path: str, limit: int, *, timeout: float = NODEOP_TIMEOUT) -> tuple[int, bytes]:
        return await self.transport.read_tail(path, limit, timeout=timeout)

    async def wait_markers(self, paths: list[str], states: set[str], timeout: float,
                           watch: list[WatchedRank | None] | None = None) -> WaitMarkersAnswer:
        return await self.transport.wait_markers(paths, states, timeout, watch)

    async def read_json(self, path: str, *, limit: int = 65536) -> dict | None:
        """A small JSON file on the node, or None when it is missing or unreadable (never raises for that)."""
        try:
            data = await self.read_file(path, limit=limit)
        except ClusterctlError:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.transport.close()


def handles(nodes: list[Node], ssh: Connector, *, keeper_grace: float = 10.0,
            runtime_dirs: dict[str, str] | None = None) -> dict[str, NodeHandle]:
    out = {}
    for n in nodes:
        out[n.name] = NodeHandle(n, ssh.transport(n, keeper_grace=keeper_grace),
                                 runtime_dir=(runtime_dirs or {}).get(n.name) or n.runtime_dir)
    return out


async def close_all(hs: dict[str, NodeHandle]) -> None:
    await asyncio.gather(*(h.close() for h in hs.values()), return_exceptions=True)


class NodePool:
    """Node handles kept across the looks of one command (``status --watch``, ``reap`` over several jobs): one
    connection and one op session per node, reopened only when it dropped (opsession.NodeOps.session)."""

    def __init__(self, ssh: Connector, *, keeper_grace: float = 10.0):
        self.ssh, self.keeper_grace = ssh, keeper_grace
        self.kept: dict[tuple, NodeHandle] = {}

    def handles(self, nodes: list[Node]) -> dict[str, NodeHandle]:
        out = {}
        for n in nodes:
            key = (n.name, n.host, n.port, n.user, n.identity_file, n.python, n.runtime_dir, n.is_local)
            if key not in self.kept:
                self.kept[key] = handles([n], self.ssh, keeper_grace=self.keeper_grace)[n.name]
            out[n.name] = self.kept[key]
        return out

    async def close(self) -> None:
        kept, self.kept = self.kept, {}
        await asyncio.gather(*(h.close() for h in kept.values()), return_exceptions=True)


def first_error_code(errors: list[BaseException]):
    """One exit code for several per-node errors: the shared one, or 1 (failed on at least one host)."""

    codes = {getattr(e, "exit_code", Exit.FAILED) for e in errors}
    return codes.pop() if len(codes) == 1 else Exit.FAILED


__all__ = ["NodeHandle", "NodePool", "Connector", "handles", "close_all", "make_transport", "node_python",
           "NODEOP_TIMEOUT"]


def probe_memory(nodes: list[Node], ssh: Connector) -> dict[str, float]:
    """Total RAM (GiB) of remote nodes, probed concurrently over SSH (for `plan --probe`)."""
    async def go() -> dict[str, float]:
        hs = handles(nodes, ssh)
        try:
            answers = await asyncio.gather(*(h.ask(ProbeRequest()) for h in hs.values()))
        finally:
            await close_all(hs)
        return {name: round(a.mem_total / (1 << 30), 3) for name, a in zip(hs, answers)}

    return asyncio.run(go())
