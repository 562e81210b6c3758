"""The node operations' wire (protocol/nodeops.py): every op's request and answer survive the JSON line both ways,
the lines are the ones older versions wrote, a malformed answer is refused with a typed error on the coordinator and a
malformed request with ``bad request`` on the node."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys

import pytest

from clusterctl.connect.faketransport import ScriptedOps, fake_ssh
from clusterctl.connect.nodes import close_all, handles
from clusterctl.errors import ClusterctlError, RemoteCommandFailed
from clusterctl.node import nodeops
from clusterctl.plan.inventory import Node
from clusterctl.protocol import nodeops as wire
from clusterctl.protocol.identity import Identity

IDENT = Identity(pid=4242, start_time=1.5, nonce="ab" * 8, pgid=4242, boot_id="boot")
MANIFEST = {"schema_version": 1, "files": []}

# one request and one answer of every op, as the coordinator and the node make them
SAMPLES: dict[str, tuple[wire.Request, wire.Answer]] = {
    "probe": (wire.ProbeRequest(backend="ring", model_path="/m", manifest=MANIFEST, verify=True, ports=[5000],
                                runtime_dir="/run/c"),
              wire.ProbeAnswer(hostname="h", boot_id="b", time=1.0, versions={"clusterctl": "1", "mlx": None},
                               mem_available=1, mem_total=2, default_runtime_dir="/run/c", backend_available=True,
                               model=wire.ModelFolder(ok=True, files=["a.safetensors"]),
                               copy_check=wire.CopySummary(state="stale", n_stale=1, first="a.safetensors"),
                               ports_busy=[5000], runtime_dir=wire.RuntimeDirCheck(path="/run/c", ok=True))),
    "stop": (wire.StopRequest(targets=[IDENT], grace=2.0),
             wire.StopAnswer(results=[wire.StopResult(pid=4242, status="gone", detail="")])),
    "kill_group": (wire.KillGroupRequest(pid=4242, pgid=4242, start_time=1.5, boot_id="boot"),
                   wire.KillGroupAnswer(killed=False)),
    "alive": (wire.AliveRequest(targets=[IDENT, Identity(pid=7)]), wire.AliveAnswer(status=["alive", "foreign"])),
    "sweep": (wire.SweepRequest(runtime_dir="/run/c", job_id="j", nonce="ab" * 8, grace=1.0, extra=[IDENT],
                                ranks=[0, 2]),
              wire.StopAnswer(results=[wire.StopResult(pid=9, status="survived", detail="still running")])),
    "clean": (wire.CleanRequest(runtime_dir="/run/c", job_id="j"), wire.CleanAnswer(removed=["j-rank0.json"])),
    "spawn": (wire.SpawnRequest(argv=["python3", "-m", "clusterctl.rank"], env={"CLUSTERCTL_NONCE": "n"},
                                log_path="/run/c/j-rank0.log"),
              wire.SpawnAnswer(pid=10, pgid=10, start_time=3.25, boot_id=None)),
    "canary": (wire.CanaryRequest(url="http://127.0.0.1:8000", api_key="k", timeout=120),
               wire.CanaryAnswer(ok=True, tokens=2, text="hi", seconds=0.5)),
    "markers": (wire.MarkersRequest(runtime_dir="/run/c", job_id="j"),
                wire.MarkersAnswer(markers=[wire.MarkerEntry(path="/run/c/j-rank0.json", marker={"rank": 0},
                                                             age=0.5),
                                            wire.MarkerEntry(path="/run/c/j-rank1.json", error="unreadable")],
                                   time=5.0)),
    "wait_markers": (wire.WaitMarkersRequest(paths=["/a", "/b"], states=["ready"], timeout=3.0,
                                             watch=[None, wire.WatchedRank(**IDENT.model_dump(), log_path="/l")]),
                     wire.WaitMarkersAnswer(markers=[{"state": "ready"}, None],
                                            exited=[None, wire.Exited(log_tail=["boom"])])),
    "read": (wire.ReadRequest(path="/f", limit=10), wire.ReadAnswer(data="eA==")),
    "tail": (wire.TailRequest(path="/log", limit=10), wire.TailAnswer(size=11, data="eA==")),
    "write": (wire.WriteRequest(path="/f", data="eA==", mode=0o644), wire.WriteAnswer(written=1)),
    "warm": (wire.WarmRequest(modules=["psutil"]), wire.WarmAnswer(imported=["psutil"], failed={"x": "no"})),
    "model_status": (wire.ModelStatusRequest(manifest=MANIFEST, path="/m", verify=False, only=None),
                     wire.ModelStatusAnswer(state="partial", path="/m", expected_hash="sha256:0", missing=["b"],
                                            n_missing=1, n_stale=0, free_bytes=10,
                                            rsync=wire.RsyncFacts(path="/usr/bin/rsync", version="3.2"))),
    "model_prepare": (wire.ModelPrepareRequest(path="/m"), wire.ModelPrepareAnswer(path="/m", free_bytes=5)),
    "fetch": (wire.FetchRequest(url="http://mirror", path="/m", manifest=MANIFEST, files=["a"]),
              wire.FetchAnswer(done=[], failed=[wire.FetchFailure(path="a", error="HTTP 404")], bytes=0)),
}


def test_every_op_has_a_request_model_an_answer_model_and_a_sample():
    assert set(wire.REQUESTS) == set(nodeops.OPS) == set(SAMPLES)
    for op, (req, ans) in SAMPLES.items():
        assert req.op == op and isinstance(ans, req.answer)


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_a_request_and_its_answer_survive_the_json_line(op):
    req, ans = SAMPLES[op]
    line = json.dumps({"id": 1, "op": req.op, "req": req.wire()})
    back = json.loads(line)
    assert wire.REQUESTS[back["op"]].model_validate(back["req"]) == req
    doc = json.loads(json.dumps({"id": 1, "answer": ans.wire()}))["answer"]
    got = wire.parse_answer(req, doc, node="n", argv=[])
    assert got == ans and got.wire() == ans.wire()


def test_the_lines_are_the_ones_older_versions_wrote_and_read():
    # only the fields an op sets travel; the names stay (``model_copy`` though pydantic owns the attribute)
    assert wire.ProbeRequest().wire() == {}
    assert wire.MarkersRequest(runtime_dir="/r", job_id="j").wire() == {"runtime_dir": "/r", "job_id": "j"}
    assert wire.AliveRequest(targets=[IDENT]).wire() == {"targets": [
        {"pid": 4242, "start_time": 1.5, "nonce": "ab" * 8, "pgid": 4242, "boot_id": "boot"}]}
    probe = wire.ProbeAnswer(runtime_dir=wire.RuntimeDirCheck(path="/r", ok=True))
    probe.copy_check = wire.CopySummary(state="ok")
    assert probe.wire() == {"runtime_dir": {"path": "/r", "ok": True}, "model_copy": {"state": "ok"}}
    assert wire.ModelPrepareAnswer(error="cannot create /m").wire() == {"error": "cannot create /m"}
    # an older node's probe (no field it did not know) still parses as far as its versions, and a newer one's
    # fields are ignored: preflight then judges the versions
    old = wire.ProbeAnswer.model_validate({"versions": {"clusterctl": "0.0.1"}, "hostname": "h", "new": {"x": 1}})
    assert old.versions == {"clusterctl": "0.0.1"} and old.runtime_dir is None and old.mem_available == 0


def test_the_node_answers_real_requests_with_its_models(tmp_path):
    (tmp_path / "j-rank0.json").write_text(json.dumps({"rank": 0, "state": "serving"}))
    (tmp_path / "j-rank1.json").write_text("{garbled")
    (tmp_path / "other-rank0.json").write_text("{}")
    ans = wire.MarkersAnswer.model_validate(nodeops.serve("markers", {"runtime_dir": str(tmp_path), "job_id": "j"}))
    assert [(m.rank, m.error) for m in ans.markers] == [(0, None), (None, "unreadable or foreign marker")]
    me = Identity(pid=os.getpid(), start_time=None)
    assert nodeops.serve("alive", wire.AliveRequest(targets=[me]).wire()) == {"status": ["alive"]}
    data = base64.b64encode(b"hello").decode()
    assert nodeops.serve("write", {"path": str(tmp_path / "f"), "data": data}) == {"written": 5}
    assert nodeops.serve("read", {"path": str(tmp_path / "f")}) == {"data": data}
    assert nodeops.serve("clean", {"runtime_dir": str(tmp_path), "job_id": "j"})["removed"] != []
    assert sorted(os.listdir(tmp_path)) == ["f", "other-rank0.json"]


def test_kill_group_signals_a_group_only_while_its_leader_is_the_process_reported():
    """The SSH transport's forced stop of a keeper that outlived its grace is this op (no program sent to the
    node's Python): a pid reused since the report is never signalled."""
    from clusterctl.protocol.identity import boot_id, start_time_of

    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        born = start_time_of(p.pid)
        req = {"pid": p.pid, "pgid": p.pid, "start_time": born, "boot_id": boot_id()}
        assert nodeops.serve("kill_group", {**req, "start_time": born + 5}) == {"killed": False}
        assert nodeops.serve("kill_group", {**req, "boot_id": "another-boot"}) == {"killed": False}
        assert p.poll() is None
        assert nodeops.serve("kill_group", req) == {"killed": True}
        assert p.wait(timeout=10) == -9
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_tail_of_a_log_is_its_last_bytes_and_its_size_never_through_a_link_or_a_fifo(tmp_path):
    """A rank's log kept after a failed launch is read by this op (launch/ranklogs.py), not by a program sent to
    the node's Python."""
    log = tmp_path / "j-rank0.log"
    log.write_bytes(b"line one\nline two\nthe last line\n")
    ans = wire.TailAnswer.model_validate(nodeops.serve("tail", {"path": str(log), "limit": 14}))
    assert ans.size == 32 and base64.b64decode(ans.data) == b"the last line\n"
    whole = wire.TailAnswer.model_validate(nodeops.serve("tail", {"path": str(log)}))
    assert base64.b64decode(whole.data) == log.read_bytes()
    (tmp_path / "link.log").symlink_to(log)
    os.mkfifo(tmp_path / "fifo.log")
    for name, why in [("link.log", "cannot open"), ("fifo.log", "not a regular file"), ("gone.log", "cannot open")]:
        with pytest.raises(ClusterctlError, match=why):
            nodeops.serve("tail", {"path": str(tmp_path / name)})


@pytest.mark.parametrize("op, req, why", [
    ("tail", {"path": "/log", "limit": -1}, "limit"),
    ("clean", {}, "runtime_dir: Field required"),
    ("alive", {"targets": [{"pid": "x"}]}, "targets.0.pid"),
    ("read", {"path": "/f", "limit": "lots"}, "limit"),
])
def test_a_malformed_request_is_refused_by_the_node(op, req, why):
    with pytest.raises(nodeops.BadRequest, match=f"bad request: {why}"):
        nodeops.serve(op, req)


def test_the_one_shot_entry_answers_a_bad_request_with_an_error_document():
    p = subprocess.run([sys.executable, "-m", "clusterctl.node.nodeops", "clean"], input=b"{}", capture_output=True,
                       timeout=60)
    assert p.returncode == 1 and "bad request: runtime_dir" in json.loads(p.stdout)["error"]


@pytest.mark.parametrize("op, answer, field", [
    ("alive", {"status": "alive"}, "status"),  # not a list
    ("alive", {"status": ["gone"]}, "status.0"),  # not a status a node gives
    ("sweep", {"results": [{"pid": 7, "status": "terminated"}]}, "results.0.status"),
    ("spawn", {"pid": 7, "pgid": 7, "start_time": 1.0}, "boot_id"),  # missing
    ("markers", {"markers": [{"path": "/p", "age": "old"}]}, "markers.0.age"),
])
def test_a_malformed_answer_is_refused_with_a_typed_error(op, answer, field):
    node = Node(name="a", host="10.0.0.1")
    req = SAMPLES[op][0]

    async def go():
        hs = handles([node], fake_ssh({"a": ScriptedOps({op: lambda r: answer})}))
        try:
            return await hs["a"].ask(req)
        finally:
            await close_all(hs)

    with pytest.raises(wire.BadAnswer, match=f"node a: {op} answered malformed: {field}") as e:
        asyncio.run(go())
    assert isinstance(e.value, RemoteCommandFailed) and e.value.host == "a"


def test_an_answer_that_is_only_an_error_raises_it():
    node = Node(name="a", host="10.0.0.1")

    ops = ScriptedOps({"model_prepare": lambda r: nodeops.op_model_prepare(wire.ModelPrepareRequest(**r))})

    async def go():
        hs = handles([node], fake_ssh({"a": ops}))
        try:
            return await hs["a"].ask(wire.ModelPrepareRequest(path="m"))
        finally:
            await close_all(hs)

    with pytest.raises(RemoteCommandFailed, match="model path 'm' is not absolute"):
        asyncio.run(go())


@pytest.mark.parametrize("doc", [
    {"pid": True, "start_time": 1.0},  # a bool is not a pid
    {"pid": 5, "start_time": "1.0"},  # no lax conversion of a garbled marker
    {"pid": 1, "start_time": 1.0},
    {"pid": 5, "start_time": 1.0, "pgid": 0},
    {"pid": 5, "start_time": 1.0, "boot_id": 7},
    {"start_time": 1.0},
])
def test_a_garbled_marker_names_no_process(doc):
    assert Identity.from_marker(doc, "n") is None


def test_a_marker_names_its_process_with_the_jobs_nonce():
    doc = {"pid": 5, "start_time": 2, "pgid": 5, "boot_id": "b", "state": "serving", "rank": 0}
    assert Identity.from_marker(doc, "n") == Identity(pid=5, start_time=2.0, nonce="n", pgid=5, boot_id="b")
