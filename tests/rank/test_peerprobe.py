"""The peer-loss ladder's parts: the pure ladder, and real UDP probes between a prober and responders."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from clusterctl.rank.peerprobe import Ladder, Prober, Responder, Waker, announce_joining, job_token, watched_peers
from clusterctl.protocol.rankspec import DEFAULT_ABORT_GRACE as DEFAULT_GRACE, abort_grace_from_env as grace_from_env


def test_ladder_suspect_abort_then_lost_after_the_grace():
    lad = Ladder(tolerance=2, grace=5.0)
    assert lad.observe(1, False, 0.0) == []
    assert lad.observe(1, False, 0.5) == ["suspect", "abort"]
    assert lad.observe(1, False, 1.0) == []
    assert lad.observe(1, False, 5.4) == []
    assert lad.observe(1, False, 5.5) == ["lost"]


def test_ladder_a_peer_back_inside_the_grace_leaves_serving_alone():
    lad = Ladder(tolerance=2, grace=5.0)
    lad.observe(1, False, 0.0)
    assert lad.observe(1, False, 0.5) == ["suspect", "abort"]
    assert lad.observe(1, True, 2.0) == ["recovered"]
    assert lad.observe(1, False, 2.5) == []  # the count starts over
    assert lad.observe(1, True, 3.0) == []
    assert lad.observe(2, False, 3.0) == []  # peers are independent


def test_ladder_without_grace_is_the_plain_exit():
    lad = Ladder(tolerance=3, grace=0)
    assert [lad.observe(1, False, t) for t in (0, 1, 2)] == [[], [], ["suspect", "lost"]]


def test_who_watches_whom():
    assert watched_peers(0, 1) == []
    assert watched_peers(0, 4) == [1, 2, 3]
    assert watched_peers(2, 4) == [1, 3]
    assert watched_peers(1, 2) == [0]
    assert watched_peers(3, 4) == [0, 2]


def test_grace_from_env():
    assert grace_from_env({}) == DEFAULT_GRACE
    assert grace_from_env({"CLUSTERCTL_PEER_ABORT_GRACE": "1.5"}) == 1.5
    assert grace_from_env({"CLUSTERCTL_PEER_ABORT_GRACE": "0"}) == 0
    assert grace_from_env({"CLUSTERCTL_PEER_ABORT_GRACE": "soon"}) == DEFAULT_GRACE
    assert grace_from_env({"CLUSTERCTL_PEER_ABORT_GRACE": "-1"}) == DEFAULT_GRACE


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_probes_answered_only_for_this_job():
    token = job_token("job-1", "nonce")
    p1, p2, p3 = _free_udp_port(), _free_udp_port(), _free_udp_port()
    ours = Responder("127.0.0.1", p1, token, 1).start()
    other_job = Responder("127.0.0.1", p2, job_token("job-2", "nonce"), 2).start()  # a stale rank on a port
    try:
        prober = Prober({1: ("127.0.0.1", p1), 2: ("127.0.0.1", p2), 3: ("127.0.0.1", p3)}, token, 0, Ladder(),
                        interval=0.3, on_action=lambda a, p: None)
        assert prober.round() == {1: True, 2: False, 3: False}  # nobody listens on p3 at all
        ours.close()
        assert prober.round()[1] is False  # gone
    finally:
        ours.close()
        other_job.close()


def test_silent_names_the_peers_that_do_not_answer_at_once():
    """Used when the ring breaks before any probe missed: a dead peer's closed port is refused without waiting."""
    import time

    token = job_token("job-1", "nonce")
    p1, p2, p3 = _free_udp_port(), _free_udp_port(), _free_udp_port()
    ours = Responder("127.0.0.1", p1, token, 1).start()
    other_job = Responder("127.0.0.1", p2, job_token("job-2", "nonce"), 2).start()
    try:
        prober = Prober({1: ("127.0.0.1", p1), 2: ("127.0.0.1", p2), 3: ("127.0.0.1", p3)}, token, 0, Ladder(),
                        interval=1.0, on_action=lambda a, p: None)
        assert prober.silent(0.5) == [2, 3]  # 2 answers for another job only; nobody listens on 3
        ours.close()
        assert prober.silent(0.5) == [1, 2, 3]
        nobody = Prober({3: ("127.0.0.1", p3)}, token, 0, Ladder(), interval=1.0, on_action=lambda a, p: None)
        t0 = time.monotonic()
        assert nobody.silent(5.0) == [3]
        assert time.monotonic() - t0 < 2.0  # a closed port is refused: no need to wait out the timeout
    finally:
        ours.close()
        other_job.close()


def test_prober_thread_runs_the_ladder_to_lost():
    token = job_token("job-1", "nonce")
    port = _free_udp_port()
    actions: list[tuple[str, int]] = []
    done = threading.Event()

    def on_action(a, p):
        actions.append((a, p))
        if a == "lost":
            done.set()

    prober = Prober({1: ("127.0.0.1", port)}, token, 0, Ladder(tolerance=2, grace=0.6), interval=0.1,
                    on_action=on_action).start()
    try:
        assert done.wait(10)
    finally:
        prober.stop()
    assert actions == [("suspect", 1), ("abort", 1), ("lost", 1)]


def test_responder_ignores_garbage():
    host = "127.0.0.1"
    token = job_token("j", "n")
    port = _free_udp_port()
    r = Responder(host, port, token, 1).start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.3)
            s.sendto(b"x" * 23, (host, port))
            with pytest.raises(socket.timeout):
                s.recv(64)
    finally:
        r.close()


def test_a_join_announcement_is_repeated_until_the_last_ranks_responder_sees_it():
    host, token = "127.0.0.1", job_token("job-1", "nonce")
    port = _free_udp_port()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(announce_joining((host, port), token, 0, timeout=10)))
    t.start()  # nobody listens yet: the last rank's gate has not opened
    time.sleep(0.3)
    assert t.is_alive()
    r = Responder(host, port, token, 2).start()
    try:
        t.join(10)
        assert got == [True]
        assert r.wait_joining({0}, timeout=1) == set()
        assert r.wait_joining({0, 1}, timeout=0.2) == {1}  # rank 1 never announced
    finally:
        r.close()


def test_a_join_announcement_of_another_job_is_not_counted_and_times_out():
    host = "127.0.0.1"
    port = _free_udp_port()
    r = Responder(host, port, job_token("job-1", "nonce"), 1).start()
    try:
        assert announce_joining((host, port), job_token("job-2", "nonce"), 0, timeout=0.3) is False
        stop = threading.Event()
        stop.set()
        assert r.wait_joining({0}, timeout=5, stop=stop) == {0}  # a stop ends the wait at once
    finally:
        r.close()


@pytest.mark.slow
def test_wake_up_calls_reach_this_jobs_responders_with_the_meeting_number():
    token = job_token("job-1", "nonce")
    p1, p2, p3 = _free_udp_port(), _free_udp_port(), _free_udp_port()
    ours = Responder("127.0.0.1", p1, token, 1).start()
    other_job = Responder("127.0.0.1", p2, job_token("job-2", "nonce"), 2).start()
    got: dict[int, list[int]] = {1: [], 2: []}
    arrived = threading.Event()
    ours.on_wake = lambda seq: (got[1].append(seq), arrived.set())
    other_job.on_wake = lambda seq: got[2].append(seq)
    waker = Waker({1: ("127.0.0.1", p1), 2: ("127.0.0.1", p2), 3: ("127.0.0.1", p3)}, token, 0)
    try:
        waker.send(41)  # nobody listens on p3: no error, the call is simply lost
        assert arrived.wait(10), "the wake-up call never reached rank 1's responder"
        assert got[1] == [41]
        # the other job's responder got the datagram too, and ignored it (checked after one more round trip)
        ok = Prober({2: ("127.0.0.1", p2)}, job_token("job-2", "nonce"), 0, Ladder(), interval=5,
                    on_action=lambda a, p: None).round()
        assert ok == {2: True} and got[2] == []
    finally:
        waker.close()
        ours.close()
        other_job.close()
