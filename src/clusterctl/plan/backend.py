"""Which MLX distributed backend a plan uses, with named blockers when the asked-for one cannot work.

- ring: TCP; works everywhere (the only one on Linux CPU).
- jaccl: Thunderbolt RDMA (macOS); needs every pair of ranks to share a declared RDMA link, each side naming its
  RDMA device. `auto` picks it only when that is known for every pair; unknown links fail closed to ring.
- mpi: only when asked.
"""

from __future__ import annotations

from itertools import combinations, islice
from typing import Iterator

from clusterctl.errors import ConfigError
from clusterctl.protocol.nodespec import Node

BACKENDS = ("auto", "ring", "jaccl", "mpi")
MAX_LISTED = 8


def jaccl_blockers(nodes: list[Node]) -> Iterator[str]:
    """Every reason jaccl cannot work, lazily (auto only needs to know whether there is one)."""
    if len(nodes) < 2:
        yield "jaccl: needs at least two ranks"
    for a, b in combinations(nodes, 2):
        for x, y in ((a, b), (b, a)):
            link = x.link_to(y.name)
            if link is None or not link.rdma:
                yield f"jaccl: node {x.name} has no rdma link to node {y.name}"
            elif not link.device:
                yield f"jaccl: node {x.name}'s rdma link to node {y.name} names no device"


def all_links_fast(nodes: list[Node]) -> bool:
    for a, b in combinations(nodes, 2):
        la, lb = a.link_to(b.name), b.link_to(a.name)
        if not ((la and la.is_fast) or (lb and lb.is_fast)):
            return False
    return True


def choose_backend(requested: str, nodes: list[Node]) -> str:
    if requested not in BACKENDS:
        raise ConfigError(f"unknown backend {requested!r} (choose from {', '.join(BACKENDS)})")
    if requested == "auto":
        return "jaccl" if len(nodes) > 1 and next(jaccl_blockers(nodes), None) is None else "ring"
    if requested == "jaccl":
        blockers = list(islice(jaccl_blockers(nodes), MAX_LISTED + 1))
        if blockers:
            more = "; and more" if len(blockers) > MAX_LISTED else ""
            raise ConfigError("backend jaccl cannot work: " + "; ".join(blockers[:MAX_LISTED]) + more,
                              hint="declare rdma links with devices in cluster.toml, or use --backend ring")
    return requested


def jaccl_devices(nodes: list[Node]) -> list[list[str | None]]:
    """The N x N matrix of RDMA device names a jaccl hostfile carries (None on the diagonal)."""
    return [[None if a.name == b.name else (a.link_to(b.name).device if a.link_to(b.name) else None) for b in nodes]
            for a in nodes]
