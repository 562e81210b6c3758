"""A failed launch explains itself (issue 30): real ranks that fail at the canary, every rank's log kept under
the state dir's reports before the teardown removes the node files, the failing rank's last lines in the error
(printable: a rank's log may hold anything), locally and over a real sshd."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from launchutil import cli, local_cluster, manifests

MATMUL = "ValueError: [matmul]"


def broken_model(tmp_path: Path, tiny: Path) -> Path:
    """The tiny model with layer 0's down_proj cut to 500 input columns. A rank of a multi-rank launch loads
    without a shape check (mlx-lm strict=False, every name present), becomes ready and serves; its first
    forward, the canary's, raises a ValueError inside the step loop: the rank crashes with a traceback, rank 0
    follows through the peer-loss ladder and the canary gets no tokens. Planned from this folder itself, every
    copy matches the deployment's manifest."""
    import mlx.core as mx

    out = tmp_path / "broken"
    shutil.copytree(tiny, out)
    weights, meta = mx.load(str(out / "model.safetensors"), return_metadata=True)
    key = "model.layers.0.mlp.down_proj.weight"
    weights[key] = weights[key][:, :500]
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=meta)
    return out


def plan(tmp_path: Path, model: Path, env: dict, cluster: Path | None = None) -> tuple[str, int]:
    """(deployment file, the rank that holds layer 0)."""
    c = cluster or local_cluster(tmp_path, (2, 6))
    out = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(model), "--allocation", "proportional", "--context", "512",
        "-o", str(out), "-q", env=env, check=True)
    ranks = json.loads(out.read_text())["ranks"]
    return str(out), next(r["rank"] for r in ranks if r["start_layer"] == 0)


def no_rank_left(tmp_path: Path) -> None:
    left = [x for x in psutil.process_iter(["cmdline"])
            if "clusterctl.rank" in " ".join(x.info["cmdline"] or []) and str(tmp_path) in " ".join(
                x.info["cmdline"] or [])]
    assert not left, left


def check_kept(doc: dict, state: Path, culprit: int, node_files: list[Path]) -> Path:
    """The JSON error of a launch that failed at the canary: what it says and what it kept."""
    assert doc["ok"] is False and doc["kind"] == "LaunchFailed" and doc["teardown"]["ok"] is True, doc
    job = doc["teardown"]["job_id"]
    logs = doc["logs"]
    folder = Path(logs["folder"])
    assert folder == state / "reports" / job and f"rank logs kept in {folder}" in doc["error"]
    assert doc["error"].startswith("canary request to rank 0 produced no tokens"), doc["error"]
    assert f"rank {culprit} on " in doc["error"] and MATMUL in doc["error"], doc["error"]
    assert logs["failing_rank"] == culprit and MATMUL in logs["failing_tail"][-1]
    assert 1 < len(logs["failing_tail"]) <= 20
    assert [k["rank"] for k in logs["ranks"]] == [0, 1] and all(k["error"] is None for k in logs["ranks"])
    for k in logs["ranks"]:
        kept = Path(k["file"])
        assert kept == folder / f"rank{k['rank']}.log" and kept.stat().st_size == k["bytes"] > 0
        assert kept.stat().st_mode & 0o077 == 0
    text = (folder / f"rank{culprit}.log").read_text()
    assert "Traceback" in text and MATMUL in text and "loaded layers" in text
    assert "lost a ring peer" in (folder / f"rank{1 - culprit}.log").read_text()
    index = json.loads((folder / "ranks.json").read_text())
    assert [k["rank"] for k in index["ranks"]] == [0, 1]
    # and the teardown went on as always: nothing of the job left on the nodes, nor a manifest
    assert not [p for d in node_files for p in d.iterdir() if p.name.startswith(job)], node_files
    assert manifests(state) == []
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["foreground", "detached"])
def test_a_launch_that_fails_at_the_canary_keeps_every_rank_log_and_names_the_culprit(tmp_path, tiny, env, mode):
    dep, culprit = plan(tmp_path, broken_model(tmp_path, tiny), env)
    flags = ["--detach"] if mode == "detached" else []
    p = cli("launch", dep, *flags, "--timeout", "120", "--json", env=env)
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    folder = check_kept(doc, tmp_path / "state", culprit, [tmp_path / "run-a", tmp_path / "run-b"])
    src = [k["source"] for k in doc["logs"]["ranks"]]
    if mode == "detached":  # read from the nodes' runtime dirs before the teardown removed them
        assert src == [str(tmp_path / f"run-{n}" / f"{doc['teardown']['job_id']}-rank{r}.log")
                       for r, n in ((0, "a"), (1, "b"))]
    else:
        assert src == ["keeper channel", "keeper channel"]
    # the human form: the failing rank's last lines, then the one error line naming the folder
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: canary request") and str(folder) in lines[-1]
    no_rank_left(tmp_path)
    human = cli("launch", dep, *flags, "--timeout", "120", env=env)
    assert human.returncode == 1 and human.stdout == ""
    err = human.stderr.strip().splitlines()
    head = next((i for i, ln in enumerate(err) if ln.startswith(f"rank {culprit} on ")), None)
    assert head is not None, human.stderr
    assert "last" in err[head] and "line(s) of its log" in err[head]
    assert MATMUL in err[-2] and err[-2].startswith("  ") and err[-1].startswith("error: ")
    assert re.search(r"rank logs kept in \S+/reports/\S+$", err[-1]), err[-1]
    quiet = cli("launch", dep, *flags, "--timeout", "120", "-q", env=env)
    assert quiet.returncode == 1 and [ln for ln in quiet.stderr.splitlines() if ln.strip()] == \
        [ln for ln in quiet.stderr.splitlines() if ln.startswith(("error: ", "hint: "))]
    no_rank_left(tmp_path)


@pytest.mark.slow
def test_over_ssh_the_remote_rank_log_is_read_through_the_transport(tmp_path, tiny, sshd, env):
    from test_launch_ssh import ssh_cluster

    broken = broken_model(tmp_path, tiny)
    hostile = f"{tmp_path}/run b; $(touch {tmp_path}/PWNED) 'q'"
    c = ssh_cluster(tmp_path, sshd, runtime_b=hostile)
    c.write_text(c.read_text().replace(f'model_path = "{tiny}"', f'model_path = "{broken}"'))
    assert str(broken) in c.read_text()
    dep, culprit = plan(tmp_path, broken, env, cluster=c)
    p = cli("launch", dep, "--detach", "--json", "--known-hosts", str(sshd.known_hosts), "--timeout", "180",
            env=env)
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    check_kept(doc, tmp_path / "state", culprit, [tmp_path / "run-a", Path(hostile)])
    remote = doc["logs"]["ranks"][1]
    assert remote["source"].startswith(hostile + "/") and remote["node"] == "b"
    assert not (tmp_path / "PWNED").exists()
    no_rank_left(tmp_path)


# ---- the pieces, on real files and a real (local) transport ------------------------------------------------------

def test_printable_escapes_what_a_terminal_would_act_on():
    from clusterctl.launch.ranklogs import last_lines, printable

    assert printable("\x1b[31mred\x1b[0m\r done\u202e") == "\\x1b[31mred\\x1b[0m\\x0d done\\u202e"
    assert printable("    File \"x.py\", line 1  ") == "    File \"x.py\", line 1"
    assert printable("x" * 600).endswith("…") and len(printable("x" * 600)) == 501
    data = b"first\n\n\x1b]0;title\x07second\n" + b"\xff\xfe bad utf-8\n" + b"\n".join(b"l%d" % i for i in range(30))
    tail = last_lines(data)
    assert len(tail) == 20 and tail[-1] == "l29" and all("\x1b" not in t and "\x07" not in t for t in tail)
    assert last_lines(data, 40)[1] == "\\x1b]0;title\\x07second" and "\ufffd" in last_lines(data, 40)[2]


def _run_of(tmp_path: Path, python: str, log_path: str, marker_path: str | None = None):
    """A failed launch as keep_logs sees it: one detached rank 0 on node a (a real LocalTransport running
    ``python``) with its marker at ``marker_path``, and rank 1 that never started."""
    from clusterctl.connect.nodes import NodeHandle
    from clusterctl.connect.localnode import LocalTransport
    from clusterctl.plan.inventory import Node

    recs = [SimpleNamespace(rank=0, node="a", pid=4242, log_path=log_path, marker_path=marker_path),
            SimpleNamespace(rank=1, node="b", pid=None, log_path=None, marker_path=None)]
    h = NodeHandle(Node(name="a", local=True, memory_gb=1), LocalTransport(node="a", python=python))
    return SimpleNamespace(manifest=SimpleNamespace(ranks=recs, job_id="j"), procs={}, hs={"a": h})


def test_keep_logs_keeps_the_last_bytes_of_a_big_log_atomically(tmp_path, monkeypatch):
    from clusterctl.launch import ranklogs

    monkeypatch.setattr(ranklogs, "KEEP_BYTES", 1000)
    log = tmp_path / "rank0.log"
    log.write_bytes(b"".join(b"line %05d\n" % i for i in range(1000)))
    logs = asyncio.run(ranklogs.keep_logs(_run_of(tmp_path, sys.executable, str(log)), tmp_path / "kept"))
    k0, k1 = logs.ranks
    kept = (tmp_path / "kept" / "rank0.log").read_bytes()
    assert len(kept) == 1000 and kept.endswith(b"line 00999\n") and k0.truncated and k0.bytes == 1000
    assert k0.tail[-1] == "line 00999" and k1.error == "never started" and k1.file is None
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["rank0.log", "ranks.json"]


def test_a_node_that_cannot_be_read_is_noted_not_fatal(tmp_path):
    from clusterctl.errors import LaunchFailed
    from clusterctl.launch import ranklogs

    fifo = tmp_path / "fifo.log"
    import os

    os.mkfifo(fifo)  # a FIFO planted at the log path must not hang the read
    logs = asyncio.run(ranklogs.keep_logs(_run_of(tmp_path, sys.executable, str(fifo)), tmp_path / "kept"))
    assert "not a regular file" in logs.ranks[0].error and logs.ranks[0].file is None
    logs = asyncio.run(ranklogs.keep_logs(_run_of(tmp_path, "/nonexistent/python3", str(fifo)), tmp_path / "k2"))
    assert logs.ranks[0].error and logs.ranks[0].file is None
    logs.failing = 0
    e = ranklogs.explain(LaunchFailed("canary request to rank 0 produced no tokens: HTTP Error 500"), logs)
    assert e.message.startswith("canary request to rank 0 produced no tokens: HTTP Error 500; rank logs kept in ")
    assert "(not kept: rank 0 on a: " in e.message and "\n" not in e.message
    doc = e.to_json()
    assert doc["kind"] == "LaunchFailed" and doc["logs"]["ranks"][0]["error"] and doc["logs"]["failing_tail"] == []


def test_a_rank_that_only_followed_a_lost_peer_is_not_blamed_over_one_that_failed(tmp_path):
    """The coordinator may see the follower gone first (a race): the markers' typed reasons decide."""
    from clusterctl.launch.ranklogs import KeptLog, KeptLogs, with_own_failure
    from clusterctl.protocol.runtimefiles import EndReason

    follower = KeptLog(rank=0, node="a", ended=EndReason.PEER_LOST, followed=True)
    crashed = KeptLog(rank=1, node="b", ended=EndReason.INTERNAL)
    logs = KeptLogs(folder=tmp_path, ranks=[follower, crashed])
    assert with_own_failure(0, logs) == 1
    assert with_own_failure(1, logs) == 1
    for other in (None, EndReason.PEER_LOST, EndReason.LEASE_EXPIRED):  # nobody else explains more: it stands
        quiet = KeptLogs(folder=tmp_path, ranks=[follower, KeptLog(rank=1, node="b", ended=other)])
        assert with_own_failure(0, quiet) == 0, other


def test_the_words_of_a_log_never_decide_whom_a_failed_launch_blames(tmp_path):
    """A log that reads like a follower's, beside one that reads like a crash, moves nothing without markers."""
    from clusterctl.launch.ranklogs import KeptLog, KeptLogs, with_own_failure

    follower = KeptLog(rank=0, node="a", tail=["rank 0: lost a ring peer (rank 1 did not answer)"])
    crashed = KeptLog(rank=1, node="b", tail=["Traceback (most recent call last):", "ValueError: [matmul] shapes"])
    assert with_own_failure(0, KeptLogs(folder=tmp_path, ranks=[follower, crashed])) == 0


@pytest.mark.parametrize("state, reason, followed", [
    ("failed", "peer_lost", True), ("lost", None, True), ("failed", "internal", False), ("stopping", None, False)])
def test_keep_logs_reads_each_rank_s_end_from_its_marker_file(tmp_path, state, reason, followed):
    from clusterctl.launch import ranklogs
    from clusterctl.protocol.runtimefiles import EndReason

    log, marker = tmp_path / "rank0.log", tmp_path / "rank0.marker.json"
    log.write_text("rank 0: anything at all\n")
    marker.write_text(json.dumps(dict(deployment_id="d", job_id="j", nonce="n", rank=0, node="a", host="h", pid=1,
                                      pgid=1, start_time=1.0, boot_id=None, state=state, heartbeat_at=2.0,
                                      reason=reason)))
    logs = asyncio.run(ranklogs.keep_logs(_run_of(tmp_path, sys.executable, str(log), str(marker)), tmp_path / "k"))
    k0, k1 = logs.ranks
    assert (k0.ended, k0.followed) == (EndReason(reason) if reason else None, followed)
    assert (k1.ended, k1.followed) == (None, False)  # never started: no marker read
    marker.write_text("{garbled")
    logs = asyncio.run(ranklogs.keep_logs(_run_of(tmp_path, sys.executable, str(log), str(marker)), tmp_path / "k2"))
    assert (logs.ranks[0].ended, logs.ranks[0].followed) == (None, False)
