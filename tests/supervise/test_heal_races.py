"""Whom a loss blames, when a rank exits at every moment around it: the supervisor's own loop (supervise/loop.py)
over simulated nodes (launch/fakecluster.py: the real launch, look, teardown, replan and relaunch code, in
milliseconds) on a clock the test turns. Rank 0 is SIGKILLed; rank 1 follows it out (exit 69, its marker's typed
reason ``peer_lost``) before, at or after the supervisor's looks; the heal must land on rank 1's node each time."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from clusterctl.launch.fakecluster import SimulatedNode
from clusterctl.connect.faketransport import fake_ssh
from clusterctl.supervise.policy import HealPolicy
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.supervise.loop import Supervisor
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.statedir.state import StateDir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modelfiles import make_model  # noqa: E402

A, B = "n0000", "n0001"
# what a follower's marker says, as each of the rank's ways of noticing a lost peer writes it (rank/runtime.py)
FOLLOWERS = [
    {"state": "failed", "reason": "peer_lost", "error": "rank 1: lost a ring peer ([ring] recv failed)"},
    {"state": "failed", "reason": "peer_lost",
     "error": "rank 1: idle meeting did not finish within 30 s (a ring peer is frozen or gone)"},
    {"state": "lost", "reason": "peer_lost", "error": "rank 1: peer rank 0 lost: no probe answer for 3 s"},
]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _rank(node: SimulatedNode, job_id: str) -> tuple[int, str]:
    [(pid, path)] = [(pid, p) for pid, p in node.running.items() if f"/{job_id}-rank" in p]
    return pid, path


def _follow(node: SimulatedNode, job_id: str, words: dict) -> None:
    """Rank 1 exits as a follower: its last marker, its process gone (unless the heal's teardown was first)."""
    if not any(f"/{job_id}-rank" in p for p in node.running.values()):
        return
    pid, path = _rank(node, job_id)
    node.put_json(path, {**node._marker(path), **words})
    node.running.pop(pid)


def _deployment(state: StateDir, tmp_path: Path) -> str:
    """Two simulated nodes over a model folder here (a heal's replan reads the model's facts on this machine)."""
    model = make_model(tmp_path / "m", layers=8)
    cluster = parse_cluster({"cluster": {"name": "sim"}, "node": [
        {"name": n, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"], "memory_gb": 8, "model_path": str(model),
         "runtime_dir": "/run/fake"} for i, n in enumerate((A, B))]})
    dep = make_deployment(cluster, inspect_model(model), str(model), PlanOptions())
    return str(state.save_deployment(dep)[-1])


def _supervised(tmp_path, nodes: dict[str, SimulatedNode], grace: float = 5.0):
    """A supervisor of the two-node deployment whose nodes are ``nodes`` (simulated, through its ``ssh``)."""
    state = StateDir(tmp_path / "state")
    ref = _deployment(state, tmp_path)
    clock = Clock()
    opts = LaunchOptions(check_model=False, detach=True, timeout=30, lease_seconds=30, grace=1, http_port=27570,
                         ssh=fake_ssh(nodes))
    sup = Supervisor(state, ref, opts, HealPolicy(grace_s=grace), clock=clock, detach=True)
    return state, sup, clock


async def _kill_rank0_and_heal(sup: Supervisor, clock: Clock, nodes: dict, follow_at: float, words: dict,
                               *, until: float = 60.0) -> None:
    """SIGKILL rank 0 at 0 s (its marker still says serving), rank 1 follows at ``follow_at`` s (None: never);
    the supervisor looks every second until it serves again."""
    job = sup.job.manifest.job_id
    nodes[A].running.pop(_rank(nodes[A], job)[0])
    t0, followed = clock.t, follow_at is None
    while clock.t - t0 < until:
        if not followed and clock.t - t0 >= follow_at:
            _follow(nodes[B], job, words)
            followed = True
        await sup.step()
        if sup.job is not None and sup.job.manifest.job_id != job:
            return
        clock.t += 1.0
    raise AssertionError(f"no heal within {until} s: {sup.book.phase}: {sup.book.reason}")


def _healed_onto_b(state: StateDir, sup: Supervisor, original: str) -> None:
    assert sup.book.phase == "serving", sup.book.reason
    assert sup.book.lost == [A] and sup.current != original
    assert [r.node for r in sup.job.manifest.ranks] == [B]
    assert sup.address.port == 27570  # every relaunch binds the same port
    assert len(sup.book.changes) == 1  # one plan change spent


@pytest.mark.parametrize("trial", range(10))
def test_a_killed_rank0_heals_onto_rank1s_node_with_rank1_already_gone_at_the_look(tmp_path, trial):
    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, sup, clock = _supervised(tmp_path, nodes)

    async def go():
        await sup.take_over()
        original = sup.current
        # rank 1 is gone before the first look after the kill: 0.0-0.9 s after it, in the same second
        await _kill_rank0_and_heal(sup, clock, nodes, 0.0, FOLLOWERS[trial % len(FOLLOWERS)])
        _healed_onto_b(state, sup, original)

    asyncio.run(go())


@pytest.mark.parametrize("follow_at", [None, 1.0, 3.0, 4.0, 5.0, 6.0, 9.0, 10.0, 12.0])
def test_a_killed_rank0_heals_onto_rank1s_node_whenever_rank1_follows(tmp_path, follow_at):
    """Rank 1 exits at every moment around the loss: before the grace runs out, as it does, after it, after
    the stale period that makes the supervisor insist, or never (it stays up until the heal's teardown)."""
    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, sup, clock = _supervised(tmp_path, nodes)

    async def go():
        await sup.take_over()
        original = sup.current
        await _kill_rank0_and_heal(sup, clock, nodes, follow_at, FOLLOWERS[1])
        _healed_onto_b(state, sup, original)

    asyncio.run(go())


def test_a_loss_that_blames_every_node_relaunches_on_those_that_answer_without_spending_the_budget(tmp_path):
    """Both ranks killed, no follower: no culprit. Both nodes answer: the same plan relaunched, no plan change;
    never "no node answers" of nodes that answered, and never "leaving out" (the log, the state file) a node
    the relaunch then plans on (issue 49: "leaving out b", then relaunched on b)."""
    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, sup, clock = _supervised(tmp_path, nodes)
    said, docs = [], []
    sup.log, sup.event = said.append, docs.append

    async def go():
        await sup.take_over()
        original, job = sup.current, sup.job.manifest.job_id
        for n in (A, B):
            nodes[n].running.pop(_rank(nodes[n], job)[0])
        for _ in range(30):
            await sup.step()
            assert "no node answers" not in (sup.book.reason or "")
            if sup.job is not None and sup.job.manifest.job_id != job:
                break
            clock.t += 1.0
        assert sup.book.phase == "serving" and sup.current == original and sup.book.lost == []
        assert sorted(r.node for r in sup.job.manifest.ranks) == [A, B]
        assert sup.book.changes == [] and sup.book.wait(clock.t) == 0
        [healing] = [d for d in docs if d.state == "healing"]
        assert healing.leaving_out == [] and "no node to blame" in healing.reason, healing
        assert not [line for line in said if "leaving out" in line], said

    asyncio.run(go())


async def _die_mid_heal(sup: Supervisor, clock: Clock, nodes: dict) -> str:
    """Rank 0 SIGKILLed; the supervisor dies during the heal's teardown (the sweep on rank 1's frozen node
    never answers, then the supervisor's task is cancelled): its state file says ``healing``. The lost job."""
    job = sup.job.manifest.job_id
    nodes[A].running.pop(_rank(nodes[A], job)[0])
    frozen = asyncio.Event()
    nodes[B].answers["sweep"] = lambda req: frozen.wait()
    dying = None
    for _ in range(15):
        dying = asyncio.ensure_future(sup.step())
        await asyncio.sleep(0.2)
        if not dying.done():
            break
        clock.t += 1.0
    assert sup.book.phase == "healing" and sup.pending.leave_out == (A,)
    dying.cancel()
    await asyncio.gather(dying, return_exceptions=True)
    await sup.seen.close()
    del nodes[B].answers["sweep"]
    return job


def test_reap_rolls_back_a_heal_whose_supervisor_died_in_it(tmp_path):
    import json
    import subprocess
    import sys as _sys

    from clusterctl.statedir import healfile
    from clusterctl.launch.reaper import reap

    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, first, clock = _supervised(tmp_path, nodes)
    gone = subprocess.run([_sys.executable, "-c", "import psutil; p = psutil.Process(); print(p.pid, p.create_time())"],
                          capture_output=True, text=True, check=True).stdout.split()

    async def go():
        await first.take_over()
        job = await _die_mid_heal(first, clock, nodes)
        path = healfile.path_of(state, "sim")
        doc = json.loads(path.read_text())
        doc["supervisor"] = {**doc["supervisor"], "pid": int(gone[0]), "start_time": float(gone[1])}  # dead
        path.write_text(json.dumps(doc))
        report = await reap(state, fake_ssh(nodes), grace=1)
        assert [r["job_id"] for r in report.reaped] == [job], report.to_json()
        assert not any(n.running for n in nodes.values())  # rank 1 (alive, frozen) reaped too
        after = healfile.read(path)
        assert after.state == "degraded" and after.job is None and "died during a heal" in after.reason

    asyncio.run(go())


def test_a_successor_finishes_a_heal_its_predecessor_died_in_on_the_recorded_port(tmp_path):
    """The supervisor dies during the heal's teardown (rank 1 frozen: the sweep on its node never answers). A
    successor started without a port reuses the cluster's recorded one and finishes the heal: what is left of
    the lost job torn down verified, the job relaunched on the nodes left, ``serving``."""
    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, first, clock = _supervised(tmp_path, nodes)

    async def go():
        await first.take_over()
        original = first.current
        job = await _die_mid_heal(first, clock, nodes)

        opts = LaunchOptions(check_model=False, detach=True, timeout=30, lease_seconds=30, grace=1, http_host="",
                             ssh=fake_ssh(nodes))
        second = Supervisor(state, original, opts, HealPolicy(grace_s=5.0), clock=clock, detach=True)
        assert second.recorded.http_port == 27570 and second.pending.leave_out == (A,)
        await second.take_over()
        assert second.address.port == 27570
        assert not any(f"/{job}-rank" in p for n in nodes.values() for p in n.running.values())
        for _ in range(5):
            if second.job is not None:
                break
            await second.step()
            clock.t += 1.0
        _healed_onto_b(state, second, original)
        assert second.job.manifest.endpoint.endswith(":27570")

    asyncio.run(go())


def test_with_every_node_lost_the_supervisor_probes_for_the_rejoin_instead_of_retrying_a_heal(tmp_path):
    """Both nodes stop answering: no node answers a probe, both are lost; then the loop probes them for the
    rejoin (it does not retry a heal onto nothing every second) and goes back once they answer."""
    nodes = {A: SimulatedNode(), B: SimulatedNode()}
    state, sup, clock = _supervised(tmp_path, nodes)

    def silent(req):
        from clusterctl.connect.faketransport import NodeOpError

        raise NodeOpError("connection lost", "HostUnreachable")

    async def go():
        await sup.take_over()
        original = sup.current
        for n in (A, B):
            for op in ("markers", "alive", "probe"):
                nodes[n].answers[op] = silent
        for _ in range(20):
            await sup.step()
            clock.t += 1.0
        assert sup.book.lost == [A, B] and sup.pending is None, (sup.book.reason, sup.pending)
        assert "every node is lost" in sup.book.reason
        for n in (A, B):
            nodes[n].answers.clear()
            nodes[n].running.clear()
        for _ in range(60):
            await sup.step()
            clock.t += 1.0
            if sup.job is not None and sup.book.phase == "serving":
                break
        assert sup.current == original and sup.book.lost == []
        assert sorted(r.node for r in sup.job.manifest.ranks) == [A, B]

    asyncio.run(go())
