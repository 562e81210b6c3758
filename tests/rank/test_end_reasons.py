"""Why a rank ended is typed in its marker (protocol/runtimefiles.py: ``EndReason``): every way a rank notices a
lost peer says ``peer_lost``, and the coordinator decides who followed whom on that, not on the words."""

from __future__ import annotations

import time

from clusterctl.errors import ClusterctlError
from clusterctl.rank.watchdog import LeaseExpired, ParentGone, PeerLost, Watchdog, end_reason, peer_loss
from clusterctl.protocol.runtimefiles import EndReason, Marker, followed_a_peer

OLD_MARKER = {"schema_version": 1, "type": "rank-marker", "deployment_id": "d-1", "job_id": "j-1", "nonce": "n",
              "rank": 1, "node": "b", "host": "h", "pid": 7, "pgid": 7, "start_time": 1.0, "boot_id": None,
              "state": "failed", "heartbeat_at": 1.0, "error": "rank 1: lost a ring peer ([ring] recv)"}


def test_every_way_of_noticing_a_lost_peer_is_typed_peer_lost():
    dog = Watchdog(rank=1, on_trip=lambda e: None, lease_path=None, lease_seconds=5)
    with dog.guard(0.0, "idle meeting"):
        time.sleep(0.01)
        stuck = dog.check()
    assert "lost a ring peer" not in stuck.message  # the words differ; the reason does not
    for err in (stuck, PeerLost.ring(1, "a stale buffer"), peer_loss(RuntimeError("[ring] recv failed"), 1),
                PeerLost("rank 1: peer rank 0 lost", peers=(0,))):
        assert end_reason(err) is EndReason.PEER_LOST and int(err.exit_code) == 69
    assert end_reason(LeaseExpired("x")) is EndReason.LEASE_EXPIRED
    assert end_reason(ParentGone("x")) is EndReason.PARENT_GONE
    assert end_reason(ClusterctlError("rank 1: lost a ring peer, says the text")) is EndReason.FAILED


def test_a_follower_is_known_by_its_reason_or_its_ladder_state_and_old_markers_still_read():
    old = Marker.model_validate(OLD_MARKER)
    assert old.reason is None
    new = Marker.model_validate({**OLD_MARKER, "reason": "peer_lost"})
    assert new.reason is EndReason.PEER_LOST and new.model_dump(mode="json")["reason"] == "peer_lost"
    assert followed_a_peer("failed", "peer_lost") and followed_a_peer("lost", None)
    assert not followed_a_peer("failed", None)  # words alone make no follower
    assert not followed_a_peer("failed", "not-a-reason") and not followed_a_peer("failed", ["peer_lost"])
    assert not followed_a_peer("failed", "failed")
