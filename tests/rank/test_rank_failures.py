"""How a rank ends when something goes wrong: lost peer, stale lease, lost parent, foreign ring peer, signals,
bad input. Every case: a one-line error, no traceback, state "failed" (or "stopping") in the marker."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from procstate import running
from rankharness import PY, RankCluster, tiny_model_path

from clusterctl.protocol.runtimefiles import EndReason

pytestmark = pytest.mark.slow  # every test here starts real ranks


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


def _error_lines(c: RankCluster, r: int) -> list[str]:
    log = c.logs(r)
    assert "Traceback" not in log, log
    return [ln for ln in log.splitlines() if ln.startswith("error: ")]


class _Stream:
    """A long streaming request in the background (it ends when the rank dies). ``generating`` is set once its
    first token has arrived, i.e. once the ranks are generating (the marker lists a request from the moment it is
    accepted, queued or not); ``lines`` holds every data line and ``ended`` is set when the connection is over."""

    def __init__(self, c: RankCluster):
        self.generating, self.ended = threading.Event(), threading.Event()
        self.lines: list[bytes] = []
        self.cut = False
        threading.Thread(target=self._run, args=(c,), daemon=True).start()

    def _run(self, c: RankCluster) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "x = 1", "max_tokens": 3000, "temperature": 0, "stream": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            while line := r.readline():
                if line.startswith(b"data: "):
                    self.lines.append(line.strip())
                    self.generating.set()
        except OSError:
            self.cut = True
        finally:
            self.ended.set()

    def wait(self, timeout: float) -> bool:
        return self.generating.wait(timeout)

    def told_why(self) -> dict:
        """The stream ended as a client expects when the deployment fails: an error event (503, retry later),
        then ``[DONE]`` — never a cut connection."""
        assert self.ended.wait(10) and not self.cut, self.lines[-3:]
        assert self.lines[-1] == b"data: [DONE]", self.lines[-3:]
        err = json.loads(self.lines[-2][6:])["error"]
        assert err["type"] == "server_error" and err["code"] == "deployment_unavailable", err
        return err


def _stream_forever(c: RankCluster) -> _Stream:
    return _Stream(c)


def test_a_killed_peer_mid_request_ends_rank_0_with_one_line(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], tag="peer") as c:
        c.up()
        stream = _stream_forever(c)
        assert stream.wait(20), "the request never started"
        whole: list = []  # a request in flight without a stream gets its answer: a 503, not a cut connection

        def ask():
            conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "y", "max_tokens": 3000}),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            whole.append((r.status, r.getheader("Retry-After"), json.loads(r.read())))

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        deadline = time.monotonic() + 10
        while len(c.marker(0).active_requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        c.procs[1].send_signal(signal.SIGKILL)
        assert c.wait_exit(0, 20) == 69
        told = stream.told_why()["message"]  # the ring's error, or the ladder's when MLX hangs (as below)
        assert "lost a ring peer" in told or "peer rank 1 lost" in told, told
        asker.join(10)
        assert whole and whole[0][0] == 503 and whole[0][1] == "5", whole
        assert whole[0][2]["error"]["code"] == "deployment_unavailable"
        m = c.marker(0)
        # the ring's own error usually comes first; if MLX hangs instead, the peer-loss ladder ends it
        assert (m.state == "failed" and "lost a ring peer" in m.error) or (m.state == "lost" and "peer rank 1" in m.error)
        assert "peer rank 1" in m.error, m.error  # either way the marker names who went (`status` shows it)
        assert m.reason is EndReason.PEER_LOST  # what the supervisor decides on: typed, whatever the words
        lines = _error_lines(c, 0)
        assert len(lines) == 1 and "rank 0" in lines[0]


def test_a_stale_lease_ends_the_rank_but_a_lease_never_written_does_not(model, tmp_path):
    with RankCluster(tmp_path, model, [8], lease_seconds=1.0, tag="lease") as c:
        c.up()
        time.sleep(1.5)  # no lease file yet: not stale
        assert c.procs[0].poll() is None and c.marker(0).state == "serving"
        for seq in range(6):  # renewals keep it alive past its duration
            c.renew_lease(seq, duration=0.8)
            time.sleep(0.3)
        assert c.procs[0].poll() is None
        t0 = time.monotonic()
        assert c.wait_exit(0, 10) == 69  # renewals stopped
        assert time.monotonic() - t0 < 5
        m = c.marker(0)
        assert m.state == "failed" and "not renewed" in m.error and m.reason is EndReason.LEASE_EXPIRED
        assert len(_error_lines(c, 0)) == 1


def test_a_rank_whose_parent_dies_exits(model, tmp_path):
    c = RankCluster(tmp_path, model, [8], tag="orphan")
    spec = tmp_path / "spec-rank0.json"
    spec.write_text(json.dumps(c.spec(0)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACCL_"))}
    env["CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS"] = "1"
    log = tmp_path / "rank0.log"
    # an intermediate parent starts the rank as its keeper would (naming itself in CLUSTERCTL_KEEPER_PID),
    # reports its pid once the rank is up, then dies
    code = ("import subprocess, sys, time, os; "
            f"p = subprocess.Popen([{PY!r}, '-m', 'clusterctl.rank', '--spec', {str(spec)!r}], "
            "env={**os.environ, 'CLUSTERCTL_KEEPER_PID': str(os.getpid())}, "
            f"stdout=open({str(log)!r}, 'wb'), stderr=subprocess.STDOUT, start_new_session=True); "
            f"time.sleep(1.0); print(p.pid, flush=True)")
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, timeout=30, text=True)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 30
    while running(pid):
        assert time.monotonic() < deadline, "orphaned rank is still running"
        time.sleep(0.1)
    m = c.marker(0)
    assert m.state == "failed" and "parent process" in m.error and m.reason is EndReason.PARENT_GONE
    assert "Traceback" not in log.read_text()


def test_a_peer_from_another_job_on_the_ring_is_refused(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], per_rank={1: {"job_id": "job-other"}}, tag="mix") as c:
        c.start()
        c.wait_state("ready")
        c.open_gate()
        assert c.wait_exit(0, 30) == 65 and c.wait_exit(1, 30) == 65
        for r in range(2):
            m = c.marker(r)
            assert m.state == "failed" and "another job" in m.error
            assert len(_error_lines(c, r)) == 1


def test_ranks_wait_at_the_gate_asleep_and_stop_there_on_sigterm_or_sigint(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], tag="gate") as c:
        c.start()
        c.wait_state("ready")
        procs = [psutil.Process(p.pid) for p in c.procs]
        before = [p.cpu_times() for p in procs]
        time.sleep(1.0)
        assert all(c.marker(r).state == "ready" for r in range(2))
        for b, p in zip(before, procs):
            a = p.cpu_times()
            assert (a.user + a.system) - (b.user + b.system) < 0.3  # polling a file, not spinning in a collective
        c.procs[0].send_signal(signal.SIGTERM)
        c.procs[1].send_signal(signal.SIGINT)
        assert [c.wait_exit(r, 15) for r in range(2)] == [0, 0]
        assert "SIGINT: stopping" in c.logs(1)
        assert all(c.marker(r).state == "stopping" for r in range(2))


def test_a_stop_stuck_behind_a_frozen_peer_ends_on_the_second_signal_or_the_alarm(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], overrides={"control_timeout_s": 4.0}, tag="frozen") as c:
        c.up()
        c.signal(1, signal.SIGSTOP)  # rank 0's next idle meeting never completes
        try:
            time.sleep(0.3)
            c.signal(0, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while c.marker(0).state != "stopping":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.5)
            assert c.procs[0].poll() is None  # stuck in the collective, as expected
            t0 = time.monotonic()
            c.signal(0, signal.SIGTERM)
            assert c.wait_exit(0, 5) == 1
            assert time.monotonic() - t0 < 2
            assert "second signal" in c.marker(0).error
        finally:
            c.signal(1, signal.SIGCONT)
        # its peer is gone; MLX's ring may hang rather than raise: the exchange deadline or the peer-loss ladder
        # (whichever comes first) ends it. Or rank 0's stop vote was already in rank 1's socket when rank 1 froze:
        # rank 1 then reads it on SIGCONT and stops cleanly, as every rank does on a peer's stop (seen once in CI)
        code = c.wait_exit(1, 20)
        m = c.marker(1)
        if code == 0:
            assert m.state == "stopping" and m.reason is None, m
            return
        assert code == 69, code
        assert (m.state == "failed" and "ring" in m.error) or (m.state == "lost" and "peer rank 0 lost" in m.error)
        assert m.reason is EndReason.PEER_LOST


def test_the_stop_alarm_forces_an_exit_after_10_s(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], tag="alarm") as c:
        c.up()
        c.signal(1, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            t0 = time.monotonic()
            c.signal(0, signal.SIGTERM)
            assert c.wait_exit(0, 20) == 1
            assert 9.5 < time.monotonic() - t0 < 15
            assert "not stopped within 10 s" in c.marker(0).error
        finally:
            c.procs[1].send_signal(signal.SIGKILL)


def test_a_peer_that_never_joins_ends_the_wait_for_the_ring(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], overrides={"join_timeout_s": 3.0}, tag="lonely") as c:
        c.start(ranks=[0])  # rank 1 never starts: rank 0 would wait in connect/accept forever
        c.wait_state("ready", ranks=[0])
        c.open_gate()
        t0 = time.monotonic()
        assert c.wait_exit(0, 30) == -signal.SIGALRM  # mlx's init holds the GIL: the kernel ends it
        assert time.monotonic() - t0 < 10
        assert "joining the ring (exit by SIGALRM if not joined within 3 s)" in c.logs(0)


def _run_rank(args, env_extra=None, timeout=30):
    env = {k: v for k, v in os.environ.items() if k != "CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "clusterctl.rank", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_entry_points_fail_in_one_line(model, tmp_path):
    c = RankCluster(tmp_path, model, [8], tag="cli")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(c.spec(0)))
    out = _run_rank(["--spec", str(spec)])
    assert out.returncode == 2 and "CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS" in out.stderr
    spec.write_text(json.dumps({**c.spec(0), "start_layer": 3}))
    out = _run_rank(["--spec", str(spec)], {"CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS": "1"})
    assert out.returncode == 65 and out.stderr.count("\n") == 1 and "start" not in out.stdout
    spec.write_text(json.dumps({**c.spec(0), "model_path": str(tmp_path / "none")}))
    out = _run_rank(["--spec", str(spec)], {"CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS": "1"})
    assert out.returncode == 78 and "no model" in out.stderr and "Traceback" not in out.stderr
    assert c.marker(0).state == "failed"
    unsigned = tmp_path / "contract"
    unsigned.write_text(json.dumps(c.spec(0)))
    out = _run_rank(["--contract", str(unsigned), "--node", "node0"])
    assert out.returncode == 65 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_a_busy_http_port_is_a_config_error(model, tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        c = RankCluster(tmp_path, model, [8], overrides={"http_port": s.getsockname()[1]}, tag="busy")
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(c.spec(0)))
        out = _run_rank(["--spec", str(spec)], {"CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS": "1"})
        assert out.returncode == 78 and "cannot listen" in out.stderr
    finally:
        s.close()


def _ladder_lines(log: str) -> list[str]:
    keys = ("missed 2 probes", "abort stage", "answers again", " lost: ")
    return [k for ln in log.splitlines() for k in keys if k in ln]


def test_a_frozen_peer_is_handled_by_the_ladder_not_a_hang(model, tmp_path):
    over = {"probe_interval_s": 0.3, "abort_grace_s": 1.5}
    with RankCluster(tmp_path, model, [4, 4], overrides=over, tag="ladder") as c:
        c.up()
        c.signal(1, signal.SIGSTOP)  # alive but answering nothing: rank 0's idle meeting would wait 30 s
        try:
            t0 = time.monotonic()
            assert c.wait_exit(0, 20) == 69
            # 2 probes (0.6 s) + 1.5 s of grace, then the exit; far less than the 30 s exchange deadline
            assert time.monotonic() - t0 < 12
        finally:
            c.procs[1].send_signal(signal.SIGKILL)
        log = c.logs(0)
        assert _ladder_lines(log) == ["missed 2 probes", "abort stage", " lost: "], log
        m = c.marker(0)
        assert m.state == "lost" and "peer rank 1 lost" in m.error and m.reason is EndReason.PEER_LOST
        assert len(_error_lines(c, 0)) == 1
        assert m.cancel_epoch is None or m.cancel_epoch >= 1


def test_a_middle_stage_frozen_mid_flight_is_ended_by_the_ladder(model, tmp_path):
    """Overlapped pipeline of 3 ranks, two requests in flight (one micro-batch each), the middle stage frozen:
    rank 0 waits inside a receive, not a meeting; the ladder still ends it cleanly, in bounded time."""
    over = {"probe_interval_s": 0.3, "abort_grace_s": 1.5}
    with RankCluster(tmp_path, model, [3, 3, 2], overrides=over, tag="midfreeze") as c:
        c.up()
        streams = [_stream_forever(c), _stream_forever(c)]
        assert all(s.wait(30) for s in streams), "the requests never started"
        assert "decode schedule overlap" in c.logs(0)
        c.signal(1, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert c.wait_exit(0, 30) == 69
            assert time.monotonic() - t0 < 15
        finally:
            c.procs[1].send_signal(signal.SIGKILL)
        log = c.logs(0)
        assert "missed 2 probes" in log and " lost: " in log, log
        assert c.marker(0).state == "lost" and len(_error_lines(c, 0)) == 1
        for s in streams:
            assert "peer rank 1" in s.told_why()["message"] or "lost a ring peer" in s.told_why()["message"]


def test_a_peer_back_inside_the_grace_leaves_the_ranks_serving(model, tmp_path):
    over = {"probe_interval_s": 0.3, "abort_grace_s": 6.0}
    with RankCluster(tmp_path, model, [4, 4], overrides=over, tag="back") as c:
        c.up()
        c.signal(1, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "abort stage" not in c.logs(0):
            assert time.monotonic() < deadline, c.logs(0)
            time.sleep(0.05)
        c.signal(1, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while "answers again" not in c.logs(0):
            assert time.monotonic() < deadline, c.logs(0)
            time.sleep(0.05)
        time.sleep(1.0)
        assert c.procs[0].poll() is None and c.procs[1].poll() is None
        conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x = 1", "max_tokens": 4,
                                                                 "temperature": 0}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 200 and body["usage"]["completion_tokens"] == 4
        assert c.marker(0).state == "serving"


def test_a_stale_lease_first_cancels_the_requests_in_flight_then_every_rank_exits(model, tmp_path):
    with RankCluster(tmp_path, model, [4, 4], lease_seconds=1.5, overrides={"abort_grace_s": 5.0},
                     tag="leaseabort") as c:
        renewing = threading.Event()
        renewing.set()

        def renew():
            seq = 0
            while renewing.is_set():
                c.renew_lease(seq)
                seq += 1
                time.sleep(0.3)

        threading.Thread(target=renew, daemon=True).start()
        c.up()
        conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "x = 1", "max_tokens": 3000, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        events = []
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                renewing.clear()  # generating: the renewals stop, the lease goes stale while the request runs
        conn.close()
        assert [c.wait_exit(i, 20) for i in range(2)] == [69, 69]
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events if e.startswith(b"{")
                  and json.loads(e).get("choices")]
        assert "cancelled" in finals, events[-3:]  # the client got a clean end, not a cut connection
        assert events[-1] == b"[DONE]"
        # every rank watches its own node's lease on its own clock: the first to see it stale ends after the
        # abort stage, and a rank that has not judged its lease yet by then sees that peer go first
        errors = [c.marker(i).error for i in range(2)]
        assert any("not renewed" in e for e in errors), errors
        assert all("not renewed" in e or "lost a ring peer" in e for e in errors), errors
        assert "abort stage" in c.logs(0)
