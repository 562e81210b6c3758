"""The heal policy (supervise/policy.py), pure: grace, the budget and its backoff, flapping links, rejoin stability,
the phase clock and whom a loss blames. Driven by a simulated clock: hours of policy in milliseconds."""

from __future__ import annotations

import pytest

from clusterctl.supervise.persist import state_of
from clusterctl.supervise.policy import Book, HealPolicy, culprits


def test_a_blip_shorter_than_the_grace_is_no_loss():
    b = Book(HealPolicy(grace_s=5))
    b.seen_down(0, {"b"})
    b.seen_down(4, {"b"})
    assert b.due(4.9) == []
    b.seen_down(4.9, set())  # back up: the grace starts again next time
    b.seen_down(6, {"b"})
    assert b.due(10.9) == [] and b.due(11) == ["b"]


def test_the_grace_counts_from_the_last_sign_of_life_when_that_is_known():
    b = Book(HealPolicy(grace_s=5))
    b.seen_down(10, {"b"}, since={"b": 4})  # a heartbeat 6 s old when first seen stale
    assert b.due(10) == ["b"]
    b.seen_down(11, {"b"}, since={"b": 9})  # a later, younger claim never moves it forward
    assert b.down_since["b"] == 4
    b.seen_down(12, {"c"}, since={"c": 20})  # nor past now
    assert b.down_since == {"c": 12}


def test_backoff_doubles_with_every_change_in_the_window_and_the_budget_caps_it():
    p = HealPolicy(max_heals=3, window_s=600, backoff_s=10, backoff_max_s=300)
    b = Book(p)
    assert b.wait(0) == 0
    b.healed(0, ["b"])
    assert b.wait(0) == 10 and b.wait(10) == 0
    b.healed(10, ["b"])
    assert b.wait(10) == 20 and b.wait(30) == 0
    b.healed(30, ["b"])
    # three in the window: the next waits until the first leaves it (t=600), longer than the 40 s backoff
    assert b.wait(70) == pytest.approx(530) and b.wait(600) == 0
    assert b.why_waiting(100) == b.why_waiting(200) == "3 plan changes in the last 600 s (at most 3)"
    assert Book(p, changes=[0.0]).why_waiting(5) == "backoff after 1 plan change(s) in the last 600 s"
    # long after, the window is empty again: no backoff at all
    assert b.wait(5000) == 0


def test_backoff_never_exceeds_its_maximum():
    b = Book(HealPolicy(max_heals=100, window_s=10_000, backoff_s=10, backoff_max_s=60))
    for i in range(10):
        b.healed(i * 1000, ["b"])
    assert b.wait(9000) == 60


def _flap(policy: HealPolicy, *, period: float = 10.0, seconds: float = 3600.0, step: float = 1.0,
          heal_takes: float = 8.0) -> list[float]:
    """A node whose link goes down and up every ``period`` s, under a supervisor that polls every ``step``:
    the times of its heals and rejoins. A heal or rejoin takes ``heal_takes`` s (teardown, relaunch); while
    the node is in the plan, its link being down is a rank down; out of the plan, it is what the rejoin
    probes."""
    b = Book(policy)
    t, busy_until, events = 0.0, 0.0, []
    while t < seconds:
        up = int(t // period) % 2 == 1  # down first
        if t >= busy_until:
            if b.lost:  # serving on the survivors: probe the lost node
                b.probed(t, "b", up)
                if b.rejoin_now(t, idle=True):
                    b.rejoined(t)
                    events.append(t)
                    busy_until = t + heal_takes
            else:
                b.seen_down(t, set() if up else {"b"})
                if b.due(t) and b.wait(t) == 0:
                    b.healed(t, ["b"])
                    events.append(t)
                    busy_until = t + heal_takes
        t += step
    return events


def _most_in_window(events: list[float], window: float) -> int:
    return max((sum(1 for x in events if s <= x < s + window) for s in events), default=0)


def test_a_link_flapping_every_10_s_causes_at_most_3_heals_in_10_minutes():
    events = _flap(HealPolicy())
    # the defaults: the node never stays up 30 s, so it never rejoins: one heal, and quiet after it
    assert len(events) == 1


@pytest.mark.parametrize("rejoin_after", [0.0, 5.0, 9.0])
@pytest.mark.parametrize("grace", [0.0, 2.0, 5.0])
def test_even_an_eager_policy_is_held_to_3_changes_per_10_minutes_by_the_budget(rejoin_after, grace):
    p = HealPolicy(grace_s=grace, rejoin_after_s=rejoin_after, drain_s=0, backoff_s=1)
    events = _flap(p, seconds=4 * 3600, heal_takes=3.0)
    assert len(events) > 3  # it does act (heals, rejoins) ...
    assert _most_in_window(events, 600) <= 3  # ... but never more than 3 times in any 10 minutes


def test_rejoin_needs_sustained_health_then_waits_for_idle_or_the_drain_deadline():
    b = Book(HealPolicy(rejoin_after_s=30, drain_s=20, backoff_s=10))
    b.healed(0, ["b"])
    assert b.lost == ["b"] and not b.stable(100)
    b.probed(10, "b", True)
    b.probed(35, "b", False)  # one miss: stability starts over
    b.probed(36, "b", True)
    assert not b.rejoin_now(60, idle=True)
    assert b.stable(66)
    assert not b.rejoin_now(66, idle=False)  # busy: the drain starts here
    assert not b.rejoin_now(80, idle=False)
    assert b.rejoin_now(80, idle=True)  # idle: at once
    assert b.rejoin_now(86, idle=False)  # or at the drain deadline, busy or not
    b.rejoined(86)
    assert b.lost == [] and not b.stable(1000)


def test_a_miss_during_the_drain_calls_the_rejoin_off():
    b = Book(HealPolicy(rejoin_after_s=5, drain_s=10, backoff_s=0))
    b.healed(0, ["b"])
    b.probed(1, "b", True)
    assert not b.rejoin_now(6, idle=False)
    b.probed(7, "b", False)
    b.probed(8, "b", True)
    assert not b.rejoin_now(13, idle=False)  # stable again; the drain starts now, not at 6
    assert not b.rejoin_now(22, idle=False) and b.rejoin_now(23, idle=False)


def test_rejoin_waits_for_every_lost_node_and_for_the_budget():
    b = Book(HealPolicy(rejoin_after_s=5, backoff_s=100))
    b.healed(0, ["b"])
    b.healed(1, ["c"])
    assert b.lost == ["b", "c"]
    b.probed(2, "b", True)
    assert not b.stable(50)
    b.probed(3, "c", True)
    assert b.stable(50)
    assert not b.rejoin_now(50, idle=True)  # the second change's backoff (200 s) holds it
    assert b.rejoin_now(201, idle=True)


def test_probes_of_nodes_not_lost_are_ignored():
    b = Book(HealPolicy())
    b.probed(0, "z", True)
    assert b.healthy_since == {} and not b.stable(100)


def test_degraded_seconds_add_up_across_phases():
    b = Book(HealPolicy())
    assert b.set_phase(0, "serving") is False  # already
    b.set_phase(10, "healing", "rank 1 on b dead")
    b.set_phase(15, "degraded", "does not fit on a")
    assert b.degraded_seconds(20) == 5
    assert b.set_phase(25, "degraded", "still does not fit") and b.phase_since == 15
    b.set_phase(30, "healing", "rejoin")
    b.set_phase(40, "degraded", "x")
    b.set_phase(42, "serving")
    assert b.degraded_seconds(1000) == 17
    with pytest.raises(ValueError):
        b.set_phase(50, "resting")


def test_the_state_document_has_the_shape_the_front_door_reads():
    b = Book(HealPolicy())
    b.healed(0, ["b"])
    b.set_phase(1, "degraded", "model does not fit on a")
    doc = state_of(b, 3.5, since="2026-12-05T12:00:00Z", deployment="t-1", job=None, cluster="t",
                   original="t-0").model_dump(mode="json")
    assert {k: doc[k] for k in ("state", "reason", "since", "heals", "degraded_seconds", "deployment", "job")} == {
        "state": "degraded", "reason": "model does not fit on a", "since": "2026-12-05T12:00:00Z", "heals": 1,
        "degraded_seconds": 2.5, "deployment": "t-1", "job": None}
    assert doc["lost_nodes"] == ["b"] and doc["original"] == "t-0"


def test_culprits_are_the_ranks_that_did_not_only_follow_a_lost_peer():
    assert culprits([{"node": "a", "state": "dead", "follower": True},
                     {"node": "b", "state": "dead", "follower": False}]) == ["b"]
    assert culprits([{"node": "a", "state": "up"}, {"node": "b", "state": "unreachable"}]) == ["b"]
    # only followers (the one that started it left no trace): every node down is a suspect
    assert culprits([{"node": "a", "state": "dead", "follower": True},
                     {"node": "b", "state": "dead", "follower": True}]) == ["a", "b"]
    assert culprits([{"node": "a", "state": "up"}]) == []
    # a follower down, the other rank still looks up (frozen, its heartbeat not stale yet): wait, then suspect
    ranks = [{"node": "a", "state": "exited", "follower": True}, {"node": "b", "state": "up"}]
    assert culprits(ranks, insist=False) == [] and culprits(ranks) == ["a"]


def test_a_policy_with_no_budget_is_refused():
    with pytest.raises(ValueError):
        HealPolicy(max_heals=0)
    with pytest.raises(ValueError):
        HealPolicy(grace_s=-1)
