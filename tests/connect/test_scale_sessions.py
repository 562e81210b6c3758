"""Sessions kept, not reopened: ``status --watch`` over the same SSH connection every refresh (real sshd), ``reap``
one session per node for all its jobs (fake nodes)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from clusterctl.connect.faketransport import ScriptedOps, fake_ssh
from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, RankRecord, now_iso
from clusterctl.connect.nodes import Connector
from clusterctl.plan.inventory import Node
from clusterctl.statedir.state import StateDir

PY = sys.executable
DEAD = 2**22 + 12345  # no such process


def save_job(state: StateDir, dep_id: str, nodes: list[Node], *, detached: bool = True) -> LaunchManifest:
    ranks = [RankRecord(rank=i, node=n.name, host=n.host, local=False, runtime_dir=n.runtime_dir,
                        marker_path=f"{n.runtime_dir}/{dep_id}-1-rank{i}.json",
                        contract_path=f"{n.runtime_dir}/{dep_id}-1-rank{i}.contract", state="ready",
                        pid=DEAD + i, pgid=DEAD + i, start_time=1.0, boot_id="boot")
             for i, n in enumerate(nodes)]
    m = LaunchManifest(job_id=f"{dep_id}-1", deployment_id=dep_id, plan_hash="0" * 64, deployment_file="/nonexistent",
                       created_at=now_iso(), nonce="ab" * 16,
                       coordinator={"host": os.uname().nodename, "pid": DEAD, "start_time": 1.0, "boot_id": None,
                                    "detached": detached}, nodes=nodes, ranks=ranks)
    ManifestStore(state.launches, state.keyring.signing_key(), state.keyring.public_keys()).save(m)
    return m


@pytest.mark.slow
def test_status_watch_keeps_one_connection_per_node_between_refreshes(sshd, tmp_path):
    from clusterctl.launch.watch import watch

    state = StateDir(tmp_path / "state")
    nodes = [Node(name=f"n{i}", host=sshd.host, port=sshd.port, user="root", identity_file=str(sshd.client_key),
                  python=PY, runtime_dir=str(tmp_path / f"run{i}")) for i in range(2)]
    save_job(state, "dep-w", nodes)
    before = sshd.log_text().count("Accepted publickey")
    shown = []
    watch(state, Connector(known_hosts=sshd.known_hosts), None, 0.0, shown.append, count=3)
    assert len(shown) == 3 and all(r["state"] != "unreachable" for d in shown for r in d["jobs"][0]["ranks"])
    assert sshd.log_text().count("Accepted publickey") - before == 2  # one per node, not one per node per refresh


def test_status_watch_reopens_only_a_session_that_ended(tmp_path):
    from clusterctl.connect.nodes import NodePool
    from clusterctl.launch.status import status

    state = StateDir(tmp_path / "state")
    nodes = [Node(name=n, host=f"10.0.0.{i + 1}", runtime_dir="/run/c") for i, n in enumerate("ab")]
    save_job(state, "dep-w", nodes)
    ops = {n: ScriptedOps({"markers": lambda req: {"markers": []}, "alive": lambda req: {
        "status": ["dead" for _ in req["targets"]]}}) for n in "ab"}

    ssh = fake_ssh(ops)

    async def go():
        pool = NodePool(ssh)
        try:
            await status(state, ssh, pool=pool)
            await status(state, ssh, pool=pool)
            sess = pool.handles(nodes)["a"].transport._ops
            sess.pipe.kill()  # node a's session ends (its connection dropped)
            for _ in range(100):
                if not sess.alive:
                    break
                await asyncio.sleep(0.01)
            await status(state, ssh, pool=pool)
        finally:
            await pool.close()

    asyncio.run(go())
    assert (ops["a"].sessions, ops["b"].sessions) == (2, 1)
    assert ops["b"].ops() == ["markers", "alive"] * 3


def test_reap_opens_one_session_per_node_for_all_its_jobs(tmp_path):
    from clusterctl.launch.reaper import reap

    state = StateDir(tmp_path / "state")
    nodes = [Node(name=n, host=f"10.0.0.{i + 1}", runtime_dir="/run/c") for i, n in enumerate("ab")]
    for dep in ("dep-p", "dep-q", "dep-r"):
        save_job(state, dep, nodes)
    ops = {n: ScriptedOps({"markers": lambda req: {"markers": []}, "alive": lambda req: {
        "status": ["dead" for _ in req["targets"]]}, "sweep": lambda req: {"results": []},
        "clean": lambda req: {"removed": []}}) for n in "ab"}
    report = asyncio.run(reap(state, fake_ssh(ops), grace=1))
    assert len(report.reaped) == 3 and not report.failed
    for n in "ab":
        assert ops[n].sessions == 1
        assert ops[n].ops().count("alive") == 3 and ops[n].ops().count("clean") == 3
