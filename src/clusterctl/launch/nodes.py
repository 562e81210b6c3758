"""One handle per node for the coordinator: its transport, its runtime dir, and node operations over it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import ClusterctlError, IntegrityError, RemoteCommandFailed
from clusterctl.launch.transport import Transport, make_transport
from clusterctl.plan.inventory import Node

NODEOP_TIMEOUT = 120.0


@dataclass
class SshOptions:
    """Operator-level SSH choices (flags); everything else comes from cluster.toml via ssh_policy."""

    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0


def node_python(node: Node) -> str:
    # A local node runs the coordinator's own interpreter unless cluster.toml names another one.
    if node.is_local and node.python == "python3":
        return sys.executable
    return node.python


def ssh_target(node: Node, ssh: SshOptions):
    """The SshTarget of a remote node (None for a local one): the one source of its SSH options."""
    if node.is_local:
        return None
    from pydantic import ValidationError

    from clusterctl.errors import ConfigError
    from clusterctl.launch.ssh_policy import SshTarget

    try:
        return SshTarget(host=node.host, port=node.port, user=node.user,
                         identity_file=Path(node.identity_file) if node.identity_file else None,
                         known_hosts=ssh.known_hosts, accept_new_host_keys=ssh.accept_new_host_keys,
                         connect_timeout=ssh.connect_timeout)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"node {node.name}: {'.'.join(map(str, err['loc'])) or 'ssh'}: "
                          f"{err['msg'].removeprefix('Value error, ')}") from None


def transport_for(node: Node, ssh: SshOptions, *, keeper_grace: float = 10.0) -> Transport:
    return make_transport(node.name, local=node.is_local, target=ssh_target(node, ssh), python=node_python(node),
                          keeper_grace=keeper_grace)


@dataclass
class NodeHandle:
    node: Node
    transport: Transport
    runtime_dir: str | None = None
    probe: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.node.name

    async def op(self, op: str, req: dict, *, timeout: float = NODEOP_TIMEOUT) -> dict:
        """Run one node operation (clusterctl.launch.nodeops) and return its JSON answer."""
        argv = [self.transport.python, "-m", "clusterctl.launch.nodeops", op]
        result = await self.transport.run(argv, input=json.dumps(req).encode(), timeout=timeout)
        try:
            doc = json.loads(result.stdout or b"null")
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            tail = result.stderr_tail.splitlines()[-1] if result.stderr_tail else f"exit code {result.returncode}"
            raise RemoteCommandFailed(f"node {self.name}: {op} failed: {tail}", host=self.name, argv=argv,
                                      returncode=result.returncode, stderr_tail=result.stderr_tail)
        if "error" in doc and len(doc) == 1:
            raise RemoteCommandFailed(f"node {self.name}: {op} failed: {doc['error']}", host=self.name, argv=argv,
                                      returncode=result.returncode, stderr_tail=result.stderr_tail)
        return doc

    def path(self, name: str) -> str:
        assert self.runtime_dir, "runtime dir not resolved yet"
        return os.path.join(self.runtime_dir, name)

    async def read_json(self, path: str, *, limit: int = 65536) -> dict | None:
        """A small JSON file on the node, or None when it is missing or unreadable (never raises for that)."""
        try:
            data = await self.transport.read_file(path, limit=limit)
        except ClusterctlError:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    async def close(self) -> None:
        try:
            await self.transport.close()
        except Exception:
            pass


def handles(nodes: list[Node], ssh: SshOptions, *, keeper_grace: float = 10.0,
            runtime_dirs: dict[str, str] | None = None) -> dict[str, NodeHandle]:
    out = {}
    for n in nodes:
        out[n.name] = NodeHandle(n, transport_for(n, ssh, keeper_grace=keeper_grace),
                                 runtime_dir=(runtime_dirs or {}).get(n.name) or n.runtime_dir)
    return out


async def close_all(hs: dict[str, NodeHandle]) -> None:
    await asyncio.gather(*(h.close() for h in hs.values()), return_exceptions=True)


def first_error_code(errors: list[BaseException]):
    """One exit code for several per-node errors: the shared one, or 1 (failed on at least one host)."""
    from clusterctl.errors import Exit

    codes = {getattr(e, "exit_code", Exit.FAILED) for e in errors}
    return codes.pop() if len(codes) == 1 else Exit.FAILED


__all__ = ["NodeHandle", "SshOptions", "handles", "close_all", "transport_for", "node_python", "IntegrityError"]


def probe_memory(nodes: list[Node], ssh: SshOptions) -> dict[str, float]:
    """Total RAM (GiB) of remote nodes, probed concurrently over SSH (for `plan --probe`)."""
    async def go() -> dict[str, float]:
        hs = handles(nodes, ssh)
        try:
            answers = await asyncio.gather(*(h.op("probe", {}) for h in hs.values()))
        finally:
            await close_all(hs)
        return {name: round(a["mem_total"] / (1 << 30), 3) for name, a in zip(hs, answers)}

    return asyncio.run(go())
