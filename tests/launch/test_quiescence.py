"""Quiescence: one answer (busy / idle / unknown) from the ranks' own markers; missing evidence is never idle."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from clusterctl.launch.look import RankView
from clusterctl.launch.quiescence import judge


@dataclass
class R:
    rank: int
    node: str


@dataclass
class M:  # the fields of a LaunchManifest that judge reads
    ranks: list = field(default_factory=lambda: [R(0, "a"), R(1, "b")])
    job_id: str = "job-1"
    deployment_id: str = "dep"


def mk(active=(), state="serving"):
    return {"state": state, "active_requests": list(active)}


def seen(markers: dict) -> dict[int, RankView]:
    """What a look makes of what each node said: a marker document and its age, or why it could not be read."""
    return {r: RankView(error=x["error"]) if "error" in x else RankView.seen(x["marker"], x["age"])
            for r, x in markers.items()}


@pytest.mark.parametrize("markers, want", [
    ({0: {"marker": mk(), "age": 0.4}, 1: {"marker": mk(), "age": 0.9}}, "idle"),
    ({0: {"marker": mk(["r1"]), "age": 0.4}, 1: {"marker": mk(), "age": 0.9}}, "busy"),  # queued at rank 0 only
    ({0: {"marker": mk(), "age": 0.4}, 1: {"marker": mk(["r1"]), "age": 0.9}}, "busy"),  # rank 0 says idle: not enough
    ({0: {"marker": mk(), "age": 0.4}}, "unknown"),  # rank 1 has no marker
    ({0: {"marker": mk(), "age": 0.4}, 1: {"marker": mk(), "age": 12.0}}, "unknown"),  # stale heartbeat
    ({0: {"marker": mk(), "age": 0.4}, 1: {"error": "cannot reach b"}}, "unknown"),
    ({0: {"marker": mk(["r1"]), "age": 0.4}, 1: {"error": "cannot reach b"}}, "busy"),  # known work wins
    ({0: {"marker": mk(["r1"]), "age": 30.0}, 1: {"marker": mk(), "age": 0.2}}, "unknown"),  # stale, not busy
    ({0: {"marker": {"state": 3, "active_requests": "r1"}, "age": 0.4}, 1: {"marker": mk(), "age": 0.2}}, "idle"),
    ({0: {"marker": mk(), "age": None}, 1: {"marker": mk(), "age": 0.2}}, "unknown"),
])
def test_judge(markers, want):
    q = judge(M(), seen(markers))
    assert q.state == want
    assert [x.rank for x in q.ranks] == [0, 1]


def test_describe_names_ranks_and_counts():
    q = judge(M(), seen({0: {"marker": mk(["r1", "r2"]), "age": 0.1}, 1: {"error": "cannot reach b"}}))
    assert q.describe() == "rank 0 on a: 2 active request(s); rank 1 on b: unknown (cannot reach b)"
    assert judge(M(), seen({0: {"marker": mk(), "age": 0.1}, 1: {"marker": mk(), "age": 0.1}})).describe() == \
        "every rank idle"
