"""Hostfiles for MLX ranks: address choice, fresh ports, per-rank files, and an mlx.launch-compatible copy.

Fresh ports matter: ring sockets use SO_REUSEADDR|SO_REUSEPORT, so a stale rank still listening on a port pairs
silently with a new job's rank and gives wrong results. Every job gets a new port block, never one recorded in a
launch manifest that may still have live ranks.
"""

from __future__ import annotations

import ipaddress
import random
import socket

from clusterctl.errors import ConfigError
from clusterctl.protocol.deployment import Deployment
from clusterctl.protocol.nodespec import Node
from clusterctl.plan.backend import jaccl_devices

# below the kernels' ephemeral ranges (Linux 32768-60999, macOS 49152-65535): a port chosen for a ring or rank 0
# is never one the kernel may hand to an outgoing connection between preflight and the rank's bind (a ring peer
# then met "Couldn't connect (error: 111)" in a busy test run)
PORT_RANGE = (20000, 32768)


def strip_zone(addr: str) -> str:
    """``fe80::1%en10`` -> ``fe80::1``: a zone id is local to the host that wrote it, meaningless on the wire."""
    return addr.split("%", 1)[0]


def _is_link_local(addr: str) -> bool:
    try:
        return ipaddress.ip_address(strip_zone(addr)).is_link_local
    except ValueError:
        return False


def ordered_addresses(node: Node) -> list[str]:
    """Routable addresses first, link-local last; zone ids stripped; order otherwise as given."""
    addrs = [strip_zone(a) for a in node.ips]
    routable = [a for a in addrs if not _is_link_local(a)]
    return routable + [a for a in addrs if _is_link_local(a)]


def _is_v4(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).version == 4
    except ValueError:
        return False


def rank_address(node: Node, *, all_local: bool, backend: str = "ring") -> str:
    """The address other ranks connect to. MLX's ring opens AF_INET sockets: it needs an IPv4 address."""
    if all_local:
        return "127.0.0.1"
    addrs = ordered_addresses(node)
    if backend == "ring":
        addrs = [a for a in addrs if _is_v4(a)]
    if addrs:
        return addrs[0]
    if node.ips:
        raise ConfigError(f"node {node.name}: the ring backend needs an IPv4 address; ips has none")
    if node.is_local:
        raise ConfigError(f"node {node.name} is local but other ranks are remote: give it ips in cluster.toml")
    try:
        family = socket.AF_INET if backend == "ring" else 0
        return socket.getaddrinfo(node.host, None, family=family, proto=socket.IPPROTO_TCP)[0][4][0]
    except OSError as e:
        raise ConfigError(f"node {node.name}: cannot resolve {node.host} ({e}); give it ips in cluster.toml") from None


def fmt(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def choose_ports(count: int, avoid: set[int], *, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports from a random block, none in ``avoid`` (ports of manifests still on disk)."""
    rng = rng or random.SystemRandom()
    lo, hi = PORT_RANGE
    for _ in range(1000):
        base = rng.randrange(lo, hi - count)
        block = list(range(base, base + count))
        if not avoid.intersection(block):
            return block
    raise ConfigError("no free port block found (too many launch manifests on disk?)")


def ring_hostfiles(addrs: list[str], ports: list[int]) -> list[list[list[str]]]:
    """One hostfile per rank: its own entry listens on its address, the others say where to connect."""
    world = [[fmt(a, p)] for a, p in zip(addrs, ports)]
    return [world for _ in addrs]


def mlx_launch_hostfile(dep: Deployment, addrs: list[str], env: dict[str, str]) -> dict:
    """What `mlx.launch --hostfile` reads, so an operator can reproduce the launch by hand."""

    rdma = jaccl_devices(dep.nodes) if dep.backend == "jaccl" else None
    hosts = []
    for i, n in enumerate(dep.rank_nodes()):
        ssh = n.host if not n.user else f"{n.user}@{n.host}"
        entry = {"ssh": ssh, "ips": [addrs[i]]}
        if rdma is not None:
            entry["rdma"] = rdma[i]
        hosts.append(entry)
    return {"backend": dep.backend, "envs": [f"{k}={v}" for k, v in sorted(env.items())], "hosts": hosts}
