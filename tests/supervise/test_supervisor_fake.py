"""The heal supervisor (supervise/loop.py: the real ``Supervisor``, its real state dir) over two simulated nodes
(launch/fakecluster.py on the fake transport, handed in through ``LaunchOptions.ssh``: the real launch, look,
teardown, replan and relaunch code), on a clock the test turns one second per look. What docs/heal.md promises:
a node lost heals onto the node that answers; the node back rejoins the original plan; a flapping node is held by
the budget; a supervisor lost (its process gone, its lock with it) is succeeded by one that keeps its state.

A node is taken away whole (``ScriptedOps.cut``: its sessions end, new ones are refused); its ranks end
themselves cut off from their peers, and a rank of the job on the other node follows it out (its marker's typed
reason ``peer_lost``), as real ranks do (docs/heal.md: What is watched)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clusterctl.connect.faketransport import fake_ssh
from clusterctl.errors import Busy
from clusterctl.launch.fakecluster import SimulatedNode
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.launch.status import status
from clusterctl.locks import Lock
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.statedir import healfile, history
from clusterctl.statedir.healfile import SupervisorState
from clusterctl.statedir.manifest import manifest_store
from clusterctl.statedir.state import StateDir
from clusterctl.supervise.loop import PROBE_EVERY_S, Supervisor
from clusterctl.supervise.policy import HealPolicy
from modelfiles import make_model

A, B = "n0000", "n0001"
PORT = 27570
DEAD_PID = 2**22 + 12345  # no such process


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Bed:
    """Two simulated nodes, the operator's deployment file over a model folder here (a heal's replan reads the
    model's facts on this machine), the state dir, the clock, and every state document a supervisor emitted."""

    def __init__(self, tmp_path: Path):
        self.state = StateDir(tmp_path / "state")
        model = make_model(tmp_path / "m", layers=8)
        cluster = parse_cluster({"cluster": {"name": "sim"}, "node": [
            {"name": n, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"], "memory_gb": 8,
             "model_path": str(model), "runtime_dir": "/run/fake"} for i, n in enumerate((A, B))]})
        dep = make_deployment(cluster, inspect_model(model), str(model), PlanOptions())
        self.file = str(self.state.save_deployment(dep, tmp_path / "dep.json")[0])  # what systemd would name
        self.original = dep.deployment_id
        self.nodes = {A: SimulatedNode(), B: SimulatedNode()}
        self.clock = Clock()
        self.events: list[SupervisorState] = []

    def supervisor(self, policy: HealPolicy = HealPolicy(), **opts) -> Supervisor:
        """``supervise`` (relaunches detached), its nodes reached through the fake connector."""
        o = LaunchOptions(check_model=False, detach=True, timeout=30, lease_seconds=30, grace=1,
                          ssh=fake_ssh(self.nodes), **{"http_port": PORT, **opts})
        return Supervisor(self.state, self.file, o, policy, clock=self.clock, detach=True, event=self.events.append)

    def running(self, job_id: str) -> dict[str, int]:
        """Node -> how many of job ``job_id``'s rank processes run there."""
        return {n: sum(f"/{job_id}-rank" in p for p in node.running.values()) for n, node in self.nodes.items()}

    def cut(self, name: str, job) -> None:
        """Node ``name`` goes away. Its ranks end themselves; a rank of ``job`` (the manifest, or None) on another
        node follows them out: its marker says ``failed``, reason ``peer_lost``, and its process is gone."""
        self.nodes[name].cut()
        self.nodes[name].running.clear()
        if job is None or name not in {r.node for r in job.ranks}:
            return
        for r in job.ranks:
            node = self.nodes[r.node]
            if r.node != name and r.pid in node.running:
                path = node.running.pop(r.pid)
                node.put_json(path, {**node._marker(path), "state": "failed", "reason": "peer_lost",
                                     "error": f"rank {r.rank}: lost a ring peer"})

    def history(self) -> list[str]:
        return [e.get("kind") for e in history.entries(self.state, "sim")]

    def state_file(self) -> SupervisorState:
        return healfile.read(healfile.path_of(self.state, "sim"))


async def steps(sup: Supervisor, bed: Bed, seconds: float, *, world=lambda t: None, until=None) -> float | None:
    """The loop (supervise/loop.py: ``run``) one look a second for at most ``seconds`` of the test's clock:
    ``world(t)`` changes the nodes first (t: seconds since the start); returns the first t at which ``until()``
    holds after a step (None: never)."""
    t0 = bed.clock.t
    while bed.clock.t - t0 < seconds:
        world(bed.clock.t - t0)
        await sup.step()
        sup.save()
        if until is not None and until():
            return bed.clock.t - t0
        bed.clock.t += 1.0
    return None


def serving_on(sup: Supervisor, nodes: list[str]) -> bool:
    return sup.job is not None and sup.book.phase == "serving" and [r.node for r in sup.job.manifest.ranks] == nodes


async def lose_b_and_heal(sup: Supervisor, bed: Bed) -> tuple[str, float]:
    """The supervisor takes over (a detached launch on a and b); b goes away; the heal. The lost job, and when
    the supervisor served again (seconds after the loss)."""
    await sup.take_over()
    job = sup.job.manifest
    assert bed.running(job.job_id) == {A: 1, B: 1}
    bed.cut(B, job)
    healed = await steps(sup, bed, 30, until=lambda: serving_on(sup, [A]))
    assert healed is not None, (sup.book.phase, sup.book.reason)
    return job.job_id, healed


def test_a_node_lost_heals_onto_the_node_that_answers(tmp_path):
    bed = Bed(tmp_path)
    sup = bed.supervisor()

    async def go():
        lost_job, healed = await lose_b_and_heal(sup, bed)
        p = sup.book.policy
        # b silent for the grace (its rank and a's follower both down: b is blamed, a's rank only followed),
        # then torn down and relaunched on a at the next look
        assert p.grace_s <= healed <= p.grace_s + 2
        [healing] = [e for e in bed.events if e.state == "healing"]
        assert healing.leaving_out == [B] and healing.deployment == bed.original
        assert sup.book.lost == [B] and sup.current != bed.original and sup.book.heals == 1
        assert len(sup.book.changes) == 1  # one plan change spent from the budget
        assert sup.job.manifest.http_port == PORT  # the same URL
        assert bed.running(sup.job.manifest.job_id) == {A: 1, B: 0}
        assert bed.running(lost_job) == {A: 0, B: 0}
        # b's rank could not be confirmed gone (b does not answer): its job kept, to be retried
        assert sup.leftovers == [lost_job] and manifest_store(bed.state).path(lost_job).exists()
        assert bed.history() == ["heal"]
        doc = bed.state_file()
        assert (doc.state, doc.lost_nodes, doc.deployment, doc.original, doc.job, doc.heals) == (
            "serving", [B], sup.current, bed.original, sup.job.manifest.job_id, 1)
        assert doc.leaving_out is None and doc.http_port == PORT

    asyncio.run(go())


def test_the_node_back_rejoins_the_original_plan_once_it_answered_long_enough(tmp_path):
    bed = Bed(tmp_path)
    sup = bed.supervisor()

    async def go():
        lost_job, _ = await lose_b_and_heal(sup, bed)
        healed_job = sup.job.manifest.job_id
        bed.nodes[B].restore()
        probes = bed.nodes[B].ops().count("probe")
        back = await steps(sup, bed, 60, until=lambda: serving_on(sup, [A, B]))
        p = sup.book.policy
        # every probe of b passed for rejoin_after_s (a probe every PROBE_EVERY_S), then at once: no request in
        # flight
        assert back is not None and p.rejoin_after_s <= back <= p.rejoin_after_s + PROBE_EVERY_S + 1, back
        assert bed.nodes[B].ops().count("probe") - probes >= p.rejoin_after_s // PROBE_EVERY_S
        assert sup.current == bed.original and sup.book.lost == [] and len(sup.book.changes) == 2
        assert bed.history() == ["heal", "rejoin"]
        assert bed.running(sup.job.manifest.job_id) == {A: 1, B: 1}
        assert bed.running(healed_job) == {A: 0, B: 0}
        # the lost job's teardown, retried once b answered: confirmed, its manifest gone
        assert sup.leftovers == [] and not manifest_store(bed.state).path(lost_job).exists()
        doc = bed.state_file()
        assert (doc.state, doc.lost_nodes, doc.deployment, doc.http_port) == ("serving", [], bed.original, PORT)

    asyncio.run(go())


def flapping(bed: Bed, sup: Supervisor, period: float):
    """b down for ``period`` s, up for ``period`` s, and so on, from t = 0."""
    def world(t: float) -> None:
        down = int(t // period) % 2 == 0
        if down and bed.nodes[B].reachable:
            bed.cut(B, sup.job.manifest if sup.job else None)
        elif not down and not bed.nodes[B].reachable:
            bed.nodes[B].restore()
    return world


def test_a_node_flapping_every_10_s_is_healed_around_once_and_never_rejoins(tmp_path):
    """docs/heal.md, No flapping: the first loss heals once; the node never stays up 15 s, so it never rejoins,
    and nothing else changes (the job on a runs on, untouched)."""
    bed = Bed(tmp_path)
    sup = bed.supervisor()

    async def go():
        await sup.take_over()
        assert await steps(sup, bed, 30, world=flapping(bed, sup, 10), until=lambda: serving_on(sup, [A])) is not None
        job = sup.job.manifest.job_id
        probes = bed.nodes[B].ops().count("probe")
        assert await steps(sup, bed, 200, world=flapping(bed, sup, 10)) is None
        assert bed.nodes[B].ops().count("probe") > probes  # b was asked, and answered while up
        assert serving_on(sup, [A]) and sup.job.manifest.job_id == job
        assert sup.book.heals == 1 and len(sup.book.changes) == 1 and bed.history() == ["heal"]
        assert [e.state for e in bed.events].count("healing") == 1

    asyncio.run(go())


def test_an_eager_policy_on_a_flapping_node_is_held_to_its_budget(tmp_path):
    """A rejoin time (2 s) shorter than the flapping period (10 s down, 10 s up): heals and rejoins follow the
    node, but never more than ``max_heals`` in any ``window_s``, each after its doubling backoff; while the budget
    holds a heal back, ``degraded``; once the window has moved on, changes are made again."""
    policy = HealPolicy(grace_s=1, rejoin_after_s=2, max_heals=3, window_s=100, backoff_s=10, backoff_max_s=300)
    bed = Bed(tmp_path)
    sup = bed.supervisor(policy)

    async def go():
        await sup.take_over()
        await steps(sup, bed, 160, world=flapping(bed, sup, 10))
        changes = sup.book.changes
        assert len(changes) >= 4, changes  # not frozen: the window moved on
        assert all(changes[i + 3] - changes[i] >= policy.window_s for i in range(len(changes) - 3)), changes
        for i, t in enumerate(changes):  # each after the backoff of the changes still in the window before it
            recent = [c for c in changes[:i] if t - c < policy.window_s]
            if recent:
                assert t - recent[-1] >= policy.backoff_s * 2 ** (len(recent) - 1), changes
        assert bed.history()[:3] == ["heal", "rejoin", "heal"]
        assert len(bed.history()) == len(changes)
        # the budget held a heal back: nothing served meanwhile, said in the state file
        assert any(e.state == "degraded" and e.job is None and e.leaving_out == [B] for e in bed.events)

    asyncio.run(go())


def test_a_lost_supervisor_is_succeeded_by_one_that_keeps_its_state_and_finishes_the_rejoin(tmp_path):
    """The supervisor that healed onto a dies (SIGKILL, OOM). Its lock goes with its process (a flock: the
    kernel drops it), so a successor may start; its state file stays, and ``status`` says the job serves
    unsupervised. The successor (systemd's restart: the same deployment file, no --port) takes the state over:
    the original deployment, the lost node, the heal count, the recorded port; it supervises the running job
    (no relaunch) and, b back, rejoins the original plan."""
    bed = Bed(tmp_path)
    lock_path = bed.state.locks / "heal-sim.lock"
    first = bed.supervisor()
    first_lock = Lock(lock_path).acquire(what="supervision of cluster sim")  # as run_supervised holds it

    async def go():
        await lose_b_and_heal(first, bed)
        healed, job = first.current, first.job.manifest.job_id
        with pytest.raises(Busy) as refused:  # a second supervisor while the first lives: exit 75
            Lock(lock_path).acquire(what="supervision of cluster sim")
        assert refused.value.exit_code == 75
        # the first supervisor's process dies: the kernel closes its lock file; its state file names it
        first_lock.release()
        doc = bed.state_file()
        dead = doc.supervisor.model_copy(update={"pid": DEAD_PID})
        healfile.write(bed.state, doc.model_copy(update={"supervisor": dead}))
        [h] = (await status(bed.state, fake_ssh(bed.nodes))).heal
        assert h.alive is False and h.file.state == "serving"
        assert h.condition == f"supervisor dead; job {job} serving unsupervised"

        bed.events.clear()
        second = bed.supervisor(http_port=None, http_host="")
        Lock(lock_path).acquire(what="supervision of cluster sim").release()
        assert (second.original, second.current, second.book.lost, second.book.heals) == (
            bed.original, healed, [B], 1)
        assert second.recorded.http_port == PORT
        spawned = bed.nodes[A].pids
        await second.take_over()
        assert second.address.port == PORT
        assert second.job.manifest.job_id == job and bed.nodes[A].pids == spawned  # taken over, not relaunched
        bed.nodes[B].restore()
        assert await steps(second, bed, 60, until=lambda: serving_on(second, [A, B])) is not None
        assert second.current == bed.original and bed.history() == ["heal", "rejoin"]
        assert second.job.manifest.http_port == PORT
        assert bed.running(job) == {A: 0, B: 0}
        doc = bed.state_file()
        assert (doc.state, doc.lost_nodes, doc.supervisor.pid) == ("serving", [], second.me.pid)

    asyncio.run(go())


def test_a_heal_cut_short_in_its_relaunch_leaves_the_file_and_the_history_naming_one_deployment(tmp_path):
    """A stop (``teardown``, SIGTERM) during the heal's relaunch (its rank's spawn on a never answers; the step is
    cancelled, as ``run`` cancels it). The heal swapped the operator's deployment file before launching (docs/
    heal.md: as ``replan`` does), so ``launch FILE`` afterwards starts the healed deployment: the history must
    say so (its last entry: this heal, to that deployment, relaunched nothing), the way back (``replan FILE --to``
    the original) named there. Issue 49: ``launch tiny.json`` after a teardown during a heal started an id no
    history entry explained."""
    from clusterctl.launch.start import launch

    bed = Bed(tmp_path)
    sup = bed.supervisor()
    reached, never = asyncio.Event(), asyncio.Event()

    async def spawn_that_hangs(req):
        reached.set()
        await never.wait()

    async def go():
        await sup.take_over()
        bed.cut(B, sup.job.manifest)
        bed.nodes[A].answers["spawn"] = spawn_that_hangs  # the relaunch's rank on a: started, never answering
        for _ in range(30):
            step = asyncio.ensure_future(sup.step())
            while not step.done() and not reached.is_set():
                await asyncio.sleep(0.01)
            if reached.is_set():
                break
            bed.clock.t += 1.0
        assert reached.is_set() and sup.book.phase == "healing", sup.book.reason
        step.cancel()  # the stop
        await asyncio.gather(step, return_exceptions=True)
        await sup.seen.close()
        del bed.nodes[A].answers["spawn"]
        in_file = bed.state.load_deployment(bed.file)[1].deployment.deployment_id
        assert in_file != bed.original  # the heal's plan: what the file now names
        last = history.entries(bed.state, "sim")[-1]
        assert (last.get("kind"), last["from"], last["to"], last["relaunched"]) == ("heal", bed.original, in_file,
                                                                                     None), last
        o = LaunchOptions(check_model=False, detach=True, timeout=30, lease_seconds=30, grace=1, http_port=PORT,
                          ssh=fake_ssh(bed.nodes))
        running = await launch(bed.file, bed.state, o)  # the operator's `launch FILE`: the file's deployment
        assert running.manifest.deployment_id == in_file == last["to"]

    asyncio.run(go())
