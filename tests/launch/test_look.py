"""One look at a job (launch/look.py), and what status, the supervisor and the reaper judge from it, against fake
nodes (connect/faketransport.py: the real coordinator code and op sessions): whose marker counts where nodes
share a runtime dir, a node that answers one question of two, what the reaper cannot verify."""

import asyncio

from clusterctl.connect.faketransport import NodeOpError, ScriptedOps, fake_ssh
from clusterctl.connect.nodes import close_all, handles
from clusterctl.launch.look import RankView, look_at_job
from clusterctl.launch.reaper import ranks_alive
from clusterctl.statedir.state import StateDir
from clusterctl.supervise.watch import look_at
from test_fake_nodes import job



def both_markers(ages=(0.1, 0.2)) -> dict:
    """What each node of the job reads in the runtime dir the two share: both ranks' markers."""
    return {"markers": [{"marker": {"rank": r, "state": "serving", "job_id": "dep-x-1"}, "age": ages[r]}
                        for r in (0, 1)]}


def fails(why: str):
    def raise_it(req):
        raise NodeOpError(why)
    return raise_it


def fake(markers=None, alive=None) -> ScriptedOps:
    return ScriptedOps({"markers": markers or (lambda req: both_markers()),
                        "alive": alive or (lambda req: {"status": ["alive" for _ in req["targets"]]})})


def test_a_marker_counts_for_the_node_its_rank_runs_on(tmp_path):
    """Node a reads rank 1's marker too (one runtime dir); node b does not answer: rank 1 has b's error, not
    the marker a saw."""
    m = job(StateDir(tmp_path / "state"))
    seen = asyncio.run(look_at_job(m, fake_ssh({"a": fake(), "b": fake(markers=fails("disk gone"))})))
    assert seen.markers[0].marker.rank == 0 and seen.markers[0].age == 0.1
    assert seen.markers[1] == RankView(error=seen.markers[1].error) and "disk gone" in seen.markers[1].error
    assert set(seen.failed) == {"b"} and seen.procs == {0: "alive", 1: "alive"}


def test_a_node_whose_alive_fails_keeps_its_markers_for_status_not_for_the_supervisor(tmp_path):
    m = job(StateDir(tmp_path / "state"))
    script = {"a": fake(), "b": fake(alive=fails("psutil missing"))}
    seen = asyncio.run(look_at_job(m, fake_ssh(script)))
    assert seen.markers[1].marker.state == "serving" and 1 not in seen.procs and set(seen.failed) == {"b"}

    async def supervisor_look():
        hs = handles(m.nodes, fake_ssh(script))
        try:
            unreachable: dict[str, bool] = {}
            markers, procs = await look_at(m, hs, unreachable)
            return markers, procs, unreachable
        finally:
            await close_all(hs)

    markers, procs, unreachable = asyncio.run(supervisor_look())
    assert unreachable == {"a": False, "b": True}
    assert markers[1].error is not None and procs == {0: "alive"}


def test_only_the_processes_asked_for_when_markers_are_not(tmp_path):
    m = job(StateDir(tmp_path / "state"))
    script = {"a": fake(), "b": fake()}
    seen = asyncio.run(look_at_job(m, fake_ssh(script), markers=False))
    assert seen.markers == {} and seen.procs == {0: "alive", 1: "alive"}
    assert script["a"].ops() == ["alive"] and script["b"].ops() == ["alive"]


def test_the_reaper_counts_what_it_cannot_verify_as_alive(tmp_path):
    m = job(StateDir(tmp_path / "state"))

    def status(word):
        return lambda req: {"status": [word for _ in req["targets"]]}

    for a, b, running in [(status("dead"), status("dead"), False), (status("dead"), status("alive"), True),
                          (status("dead"), status("unverifiable"), True), (status("dead"), fails("no link"), True),
                          (status("foreign"), status("dead"), False)]:
        assert asyncio.run(ranks_alive(m, fake_ssh({"a": fake(alive=a), "b": fake(alive=b)}))) is running
