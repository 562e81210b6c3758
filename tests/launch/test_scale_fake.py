"""The fake transport runs every command a launch sends, foreground included, and leaks nothing; a launch saves
its manifest a few times, not once per rank; contracts stay small as the cluster grows (launch/fakecluster.py)."""

import asyncio
import gc
import json
import warnings

import pytest

from clusterctl.launch.fakecluster import SimulatedNode, simulated_contracts, simulated_deployment
from clusterctl.connect.faketransport import FakeTransport, ScriptedOps, ScriptedPipe, fake_ssh
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.statedir.manifest import ManifestStore
from clusterctl.statedir.state import StateDir


@pytest.fixture
def state(tmp_path):
    return StateDir(tmp_path / "state")


def run_launch(state, n: int, *, detach: bool, saves: list | None = None):
    from clusterctl.statedir import manifest
    from clusterctl.launch import start

    path = simulated_deployment(state, n)
    nodes = {f"n{i:04d}": SimulatedNode() for i in range(n)}
    real = manifest.ManifestStore.save_doc

    def counted(self, job_id, doc):
        if saves is not None:
            saves.append([r["state"] for r in doc["ranks"]])
        return real(self, job_id, doc)

    async def go():
        run = await start.launch(path, state, LaunchOptions(check_model=False, detach=detach, timeout=30,
                                                             lease_seconds=30, grace=1, ssh=fake_ssh(nodes)))
        ready = run.manifest.state
        report = None if detach else await run.teardown()
        return run, ready, report

    manifest.ManifestStore.save_doc = counted
    try:
        run, ready, report = asyncio.run(go())
    finally:
        manifest.ManifestStore.save_doc = real
    assert ready == "ready"
    return run, report, nodes


def test_a_foreground_launch_runs_on_fake_nodes_and_tears_down(state):
    run, report, nodes = run_launch(state, 3, detach=False)
    assert report.ok and report.manifest_removed
    for name, node in nodes.items():
        ops = node.ops()
        # the rank started through the keeper (transport.start), ended by closing its stdin, then verified gone
        assert "start" in ops and "spawn" not in ops and ("exit", 143) in [(op, r.get("returncode"))
                                                                          for op, r in node.calls]
        assert ops[-2:] == ["sweep", "clean"] and not node.running
    assert nodes["n0000"].ops().count("canary") == 1


def test_a_detached_launch_records_every_rank_in_a_few_saves(state):
    saves: list = []
    run, _, nodes = run_launch(state, 24, detach=True, saves=saves)
    assert run.manifest.state == "ready" and all(r.pid for r in run.manifest.ranks)
    assert saves[0] == ["pending"] * 24  # before the first rank starts
    assert any(s == ["started"] * 24 for s in saves[1:-1])  # every start recorded before any is called ready
    assert saves[-1] == ["ready"] * 24
    assert len(saves) <= 5, f"{len(saves)} saves for 24 ranks"
    disk = ManifestStore(state.launches, None, state.keyring.public_keys()).all()[0]
    assert [m.state for _, m in disk] == ["ready"]


def test_contracts_sent_to_a_node_do_not_grow_with_the_cluster(state, tmp_path):
    sizes = {}
    for n in (4, 48):
        st = StateDir(tmp_path / f"s{n}")
        run, _, nodes = run_launch(st, n, detach=True)
        node = nodes["n0001"]
        [contract] = [v for k, v in node.files.items() if k.endswith(".contract")]
        assert json.loads(contract)["spec"].get("layer_counts") is None  # this rank's range, not every rank's
        sizes[n] = len(contract)
    assert abs(sizes[48] - sizes[4]) < 16, sizes  # a few more digits (world size), nothing per rank


def test_contract_bytes_per_node_are_flat_from_16_to_1000_nodes(tmp_path):
    """Issue 41 item 8: every contract carried every rank's layer count (pretty-printed: ~10 bytes per rank, and
    a walk of that list per rank to check it). Bytes are deterministic; time is bench/scale.py's."""
    per_node = {}
    for n in (16, 100, 1000):
        st = StateDir(tmp_path / f"s{n}")
        contracts = simulated_contracts(st, simulated_deployment(st, n))
        assert len(contracts) == n
        per_node[n] = max(len(c) for c in contracts.values())
    # node names, rank numbers and world size gain digits; nothing grows per rank
    assert per_node[1000] - per_node[16] < 64, per_node


def test_run_is_answered_by_the_script():
    ops = ScriptedOps({"run": lambda req: {"returncode": 3, "stdout": "out", "stderr": "why"}})
    t = FakeTransport("a", ops)
    res = asyncio.run(t.run(["echo", "hi"], input=b"x"))
    assert (res.returncode, res.stdout, res.stderr) == (3, b"out", b"why")
    assert ops.calls == [("run", {"argv": ["echo", "hi"], "env": {}, "input": "x"})]


def test_a_cancelled_readline_leaves_no_pending_task():
    async def go():
        pipe = ScriptedPipe(ScriptedOps())
        for _ in range(20):
            reader = asyncio.ensure_future(pipe.readline())
            await asyncio.sleep(0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        left = asyncio.run(go())
        gc.collect()
    assert left == []


def test_a_fan_out_starts_at_most_a_burst_of_operations_per_loop_turn():
    from collections import Counter

    from clusterctl.connect.opsession import Pacer

    async def go():
        pacer, turn, passed = Pacer(), [0], []

        async def ticker():
            while True:
                turn[0] += 1
                await asyncio.sleep(0)

        async def one():
            await pacer.turn()
            passed.append(turn[0])

        t = asyncio.ensure_future(ticker())
        await asyncio.gather(*(one() for _ in range(200)))
        t.cancel()
        return passed

    per_turn = Counter(asyncio.run(go()))
    assert sum(per_turn.values()) == 200 and max(per_turn.values()) <= Pacer.BURST and len(per_turn) >= 200 // 32


def test_names_of_nodes_without_ips_are_looked_up_concurrently_off_the_loop(state, monkeypatch):
    import socket
    import threading
    import time

    from clusterctl.launch import hostfile
    from clusterctl.launch.start import rank_addresses

    dep = state.load_deployment(simulated_deployment(state, 6, ips=False))[1].deployment
    loop_thread, inflight, most, threads = threading.get_ident(), [0], [0], set()
    lock = threading.Lock()

    def slow_lookup(host, *args, **kw):
        with lock:
            inflight[0] += 1
            most[0] = max(most[0], inflight[0])
            threads.add(threading.get_ident())
        time.sleep(0.3)  # a slow resolver
        with lock:
            inflight[0] -= 1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.9.9.{int(host[1:5]) + 1}", 0))]

    monkeypatch.setattr(hostfile.socket, "getaddrinfo", slow_lookup)
    addrs = asyncio.run(rank_addresses(dep))
    assert sorted(addrs) == [f"10.9.9.{i + 1}" for i in range(6)]
    assert loop_thread not in threads and most[0] > 1


def test_a_foreground_launch_that_cannot_hold_a_connection_per_node_is_refused_up_front(state, monkeypatch):
    from clusterctl.errors import ConfigError
    from clusterctl.connect import fdlimit

    monkeypatch.setattr(fdlimit, "SLOTS", fdlimit.ConnectionSlots(limit=2))
    with pytest.raises(ConfigError, match="foreground launch keeps one connection per node open: 3 nodes") as e:
        run_launch(state, 3, detach=False)
    assert "--detach" in e.value.hint
    assert not state.launches.is_dir() or not list(state.launches.iterdir())  # nothing was started or recorded
