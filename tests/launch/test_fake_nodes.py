"""Teardown, reap, cancel and status decisions against fake nodes (connect/faketransport.py): the real
coordinator code and the real op sessions, no sshd and no ranks, milliseconds per test."""

import asyncio
import json
import os
import time

import pytest

from clusterctl.errors import Busy
from clusterctl.connect.faketransport import NodeOpError, ScriptedOps, fake_ssh
from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, RankRecord, now_iso
from clusterctl.plan.inventory import Node
from clusterctl.statedir.state import StateDir

NONCE = "ab" * 16


def job(state: StateDir, *, detached: bool = True, coordinator_pid: int | None = None) -> LaunchManifest:
    """A job of two ranks on remote nodes a and b, its coordinator dead unless ``coordinator_pid`` (this one)."""
    nodes = [Node(name=n, host=f"10.0.0.{i + 1}", runtime_dir="/run/c") for i, n in enumerate("ab")]
    ranks = [RankRecord(rank=i, node=n.name, host=n.host, local=False, runtime_dir="/run/c",
                        marker_path=f"/run/c/dep-x-1-rank{i}.json", contract_path=f"/run/c/dep-x-1-rank{i}.contract",
                        state="ready", pid=1000 + i, pgid=1000 + i, start_time=1.0, boot_id="boot")
             for i, n in enumerate(nodes)]
    pid = coordinator_pid or 2**22 + 12345  # no such process
    m = LaunchManifest(job_id="dep-x-1", deployment_id="dep-x", plan_hash="0" * 64, deployment_file="/nonexistent",
                       created_at=now_iso(), nonce=NONCE,
                       coordinator={"host": os.uname().nodename, "pid": pid, "start_time": 1.0, "boot_id": None,
                                    "detached": detached},
                       nodes=nodes, ranks=ranks)
    ManifestStore(state.launches, state.keyring.signing_key(), state.keyring.public_keys()).save(m)
    return m


@pytest.fixture
def state(tmp_path):
    return StateDir(tmp_path / "state")


def marker(rank: int, active: list[str] = (), state: str = "serving") -> dict:
    return {"marker": {"rank": rank, "state": state, "active_requests": list(active), "job_id": "dep-x-1"},
            "age": 0.2}


def node(rank: int, *, active=(), sweep="gone", alive="dead") -> ScriptedOps:
    return ScriptedOps({
        "markers": lambda req: {"markers": [marker(rank, active)]},
        "sweep": lambda req: {"results": [{"pid": 1000 + rank, "status": sweep, "detail": ""}]},
        "clean": lambda req: {"removed": []},
        "alive": lambda req: {"status": [alive for _ in req["targets"]]},
    })


def teardown(state, nodes: dict[str, ScriptedOps], **kw):
    from clusterctl.launch.teardown import teardown_command

    return asyncio.run(teardown_command(state, None, fake_ssh(nodes), grace=1, **kw))


def test_teardown_of_idle_ranks_sweeps_cleans_and_removes_the_manifest(state):
    m = job(state)
    a, b = node(0), node(1)
    t0 = time.monotonic()
    [report] = teardown(state, {"a": a, "b": b})
    assert report.ok and report.manifest_removed and time.monotonic() - t0 < 5
    assert a.ops() == ["markers", "sweep", "clean"] and b.ops() == ["markers", "sweep", "clean"]
    assert a.calls[1][1]["ranks"] == [0] and a.calls[1][1]["nonce"] == NONCE  # only this node's rank, by nonce
    assert not ManifestStore(state.launches, None, state.keyring.public_keys()).path(m.job_id).exists()


def test_teardown_refuses_a_busy_job_and_touches_nothing(state):
    job(state)
    a, b = node(0), node(1, active=["cmpl-1"])
    with pytest.raises(Busy, match="rank 1 on b: 1 active request"):
        teardown(state, {"a": a, "b": b})
    assert "sweep" not in a.ops() + b.ops()
    [report] = teardown(state, {"a": a, "b": b}, force=True)  # --force stops it all the same
    assert report.ok


def test_a_rank_that_survives_keeps_the_manifest(state):
    m = job(state)
    [report] = teardown(state, {"a": node(0), "b": node(1, sweep="survived")}, force=True)
    assert not report.ok and not report.manifest_removed
    assert ManifestStore(state.launches, None, state.keyring.public_keys()).path(m.job_id).exists()


def test_an_unreachable_node_is_reported_not_guessed(state):
    job(state)

    def down(req):
        raise NodeOpError("connection refused", "ClusterctlError")
    b = node(1)
    b.answers["sweep"] = down
    [report] = teardown(state, {"a": node(0), "b": b}, force=True)
    assert not report.ok and [r.status for r in report.ranks] == ["gone", "unreachable"]


def test_reap_leaves_a_detached_job_whose_ranks_run_and_reaps_it_once_they_are_gone(state):
    from clusterctl.launch.reaper import reap

    job(state, detached=True)
    report = asyncio.run(reap(state, fake_ssh({"a": node(0, alive="alive"), "b": node(1)}), grace=1))
    assert report.nothing_to_do
    a, b = node(0), node(1)
    report = asyncio.run(reap(state, fake_ssh({"a": a, "b": b}), grace=1))
    assert [j["job_id"] for j in report.reaped] == ["dep-x-1"] and "sweep" in a.ops()


def test_status_shows_each_rank_as_its_node_sees_it(state):
    from clusterctl.launch.status import status

    job(state)
    doc = asyncio.run(status(state, fake_ssh({"a": node(0, alive="alive"),
                                               "b": node(1, active=["r1", "r2"], alive="alive")}))).to_json()
    [j] = doc["jobs"]
    assert j["activity"] == "busy" and [r["active_requests"] for r in j["ranks"]] == [0, 2]
    assert [r["state"] for r in j["ranks"]] == ["serving", "serving"]


def test_cancel_writes_a_new_epoch_on_every_node_without_waiting(state):
    from clusterctl.launch.cancel import cancel_command

    job(state)
    a, b = node(0), node(1)
    [res] = asyncio.run(cancel_command(state, "dep-x-1", fake_ssh({"a": a, "b": b}), requests=["cmpl-1"], wait=0))
    assert res["epoch"] == 1 and res["requests"] == ["cmpl-1"]
    for ops in (a, b):
        doc = json.loads(ops.files["/run/c/dep-x-cancel.json"])
        assert (doc["epoch"], doc["requests"], doc["job_id"]) == (1, ["cmpl-1"], "dep-x-1")


def test_the_event_loop_stays_responsive_while_a_foreground_coordinator_is_asked_to_stop(state):
    """teardown asks a live foreground coordinator to stop and waits for it (up to grace + 60 s): that wait
    must yield to the event loop (node sessions' keepalives run there), never block it."""
    import signal
    import subprocess
    import sys

    import psutil

    from clusterctl.launch.teardown import teardown_command

    coord = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    try:
        coord.stdout.readline()
        m = job(state, detached=False, coordinator_pid=coord.pid)
        store = ManifestStore(state.launches, state.keyring.signing_key(), state.keyring.public_keys())
        m.coordinator.start_time = psutil.Process(coord.pid).create_time()
        m.coordinator.host = __import__("socket").gethostname()
        store.save(m)

        async def go():
            gaps, last = [], time.monotonic()

            async def tick():
                nonlocal last
                while True:
                    await asyncio.sleep(0.02)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticker = asyncio.ensure_future(tick())
            # the coordinator ignores SIGTERM: it ends only when killed, 1.5 s into the teardown's wait
            asyncio.get_running_loop().call_later(1.5, coord.send_signal, signal.SIGKILL)
            try:
                reports = await teardown_command(state, None, fake_ssh({"a": node(0), "b": node(1)}), grace=5,
                                                 force=True)
            finally:
                ticker.cancel()
            return reports, gaps

        t0 = time.monotonic()
        (report,), gaps = asyncio.run(go())
        assert report.ok and time.monotonic() - t0 >= 1.5
        assert len(gaps) > 20 and max(gaps) < 0.5, f"the event loop was blocked for {max(gaps):.2f} s"
    finally:
        coord.kill()
        coord.wait()
