"""`clusterctl cancel` is honest: an ack proves that THIS command's cancel was applied, and a cancel that was not
applied never exits 0 (docs/launch.md, `clusterctl cancel`).

The coordinator's side runs against hand-made jobs whose "ranks" are a thread answering cancel files with the
acks a test wants (the files and the manifest are real); the end-to-end test replays, with real ranks, the
sequence that once printed "acked by all 2 rank(s)" while the stream ran on.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from pathlib import Path

import pytest

from clusterctl.errors import UsageError
from clusterctl.launch.cancel import CancelNotAcked, cancel_command, cancel_job
from clusterctl.protocol.runtimefiles import ack_path, cancel_path, write_ack
from clusterctl.connect.nodes import Connector
from clusterctl.statedir.state import StateDir
from launchutil import (StreamReader, cli, launch_for_long_requests, make_job, manifests, next_event,
                        open_stream)


def put_whole(path: Path, data: bytes) -> None:
    # whole, as the product's writers do: rank 0 stats the file every 50 ms and must never see half of it
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(3)}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def oversized_cancel(deployment_id: str, job_id: str, epoch: int) -> bytes:
    """A cancel file of the job that no reader takes (over 64 KiB: a 70 KB request id, as an old CLI wrote)."""
    return json.dumps({"schema_version": 1, "type": "cancel", "deployment_id": deployment_id, "job_id": job_id,
                       "epoch": epoch, "requests": ["r" * (70 << 10)], "created_at": time.time()}).encode()


class Ranks(threading.Thread):
    """Stands in for a job's ranks: ``answer(doc)`` is called once for each new cancel file (by epoch and nonce)
    and writes whatever acks the test wants."""

    def __init__(self, path: Path, answer):
        super().__init__(daemon=True)
        self.path, self.answer = path, answer
        self.done = threading.Event()
        self.seen: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        last = None
        try:
            while not self.done.is_set():
                try:
                    doc = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    doc = None
                if doc and (doc.get("epoch"), doc.get("nonce")) != last:
                    last = (doc.get("epoch"), doc.get("nonce"))
                    self.seen.append(doc)
                    self.answer(doc)
                time.sleep(0.01)
        except BaseException as e:  # a broken stand-in fails the test, never passes it
            self.error = e

    def __enter__(self) -> "Ranks":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(5)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the stand-in ranks failed: {self.error!r}") from self.error
        if exc[0] is None:
            assert self.seen, "the stand-in ranks never saw a cancel file"


class Job:
    """A hand-made job of two ranks on one local node: its manifest, runtime dir and state dir."""

    def __init__(self, state: Path):
        self.state = state
        self.m = make_job(state, [None, None], secrets.token_hex(8))
        self.run = Path(self.m.ranks[0].runtime_dir)
        self.deployment_id, self.job_id = self.m.deployment_id, self.m.job_id


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path / "state")


def ack(j: Job, rank: int, epoch: int, applied=(), **kw) -> None:
    write_ack(str(j.run), j.deployment_id, j.job_id, rank, epoch, list(applied), **kw)


def run_cancel(j: Job, requests, wait: float) -> dict:
    return asyncio.run(cancel_job(j.m, Connector(), requests, wait=wait))


def test_the_new_epoch_is_above_every_readable_cancel_file_and_ack(job):
    """A cancel file nobody can read must not make the coordinator reuse an epoch rank 0 already consumed: the
    ranks' acks say what they took."""
    put_whole(cancel_path(job.run, job.deployment_id), oversized_cancel(job.deployment_id, job.job_id, 9))
    ack(job, 0, 4, nonce="ab" * 8)
    ack(job, 1, 4)
    res = run_cancel(job, None, 0)
    assert res["epoch"] == 5 and res["waited"] is False
    doc = json.loads(cancel_path(job.run, job.deployment_id).read_text())
    assert doc["epoch"] == 5 and len(doc["nonce"]) == 16 and doc["requests"] is None
    # a readable cancel file above the acks counts too
    res = run_cancel(job, ["cmpl-a"], 0)
    assert res["epoch"] == 6
    # one no rank would take (an epoch past the int32 of the meetings) counts for nothing: the acks' 4, plus 1
    put_whole(cancel_path(job.run, job.deployment_id), json.dumps(
        {"schema_version": 1, "type": "cancel", "deployment_id": job.deployment_id, "job_id": job.job_id,
         "epoch": 2**40, "requests": None, "created_at": 1.0}).encode())
    assert run_cancel(job, None, 0)["epoch"] == 5


def test_request_ids_a_cancel_file_cannot_carry_are_refused_in_one_line(job):
    for bad in (["r" * (70 << 10)], ["a b"], [f"cmpl-{i}" for i in range(257)]):
        with pytest.raises(UsageError) as err:
            asyncio.run(cancel_command(StateDir(job.state), job.job_id, Connector(), requests=bad, wait=0))
        assert err.value.exit_code == 2 and len(err.value.message) < 200, err.value.message
    assert not cancel_path(job.run, job.deployment_id).exists()  # nothing written


@pytest.mark.parametrize("theirs", [None, "00" * 8], ids=["no-nonce", "another-nonce"])
def test_acks_of_the_same_epoch_but_another_cancel_never_count(job, theirs):
    """Rank 0 took a cancel file of our epoch, but not ours (another writer's of the same epoch, or one without a
    nonce): neither rank 0's ack nor rank 1's (the same epoch, from the same meeting) proves ours was applied.
    The command fails, naming both."""
    def answer(doc):
        ack(job, 0, doc["epoch"], ["cmpl-x"], **({"nonce": theirs} if theirs else {}))
        ack(job, 1, doc["epoch"])

    with Ranks(cancel_path(job.run, job.deployment_id), answer):
        with pytest.raises(CancelNotAcked) as err:
            asyncio.run(cancel_command(StateDir(job.state), job.job_id, Connector(),
                                       requests=None, wait=1.5))
    assert err.value.exit_code == 1
    assert f"rank 0 of {job.job_id}, rank 1 of {job.job_id}" in err.value.message
    [res] = err.value.results
    assert res["all_acked"] is False and res["acks"] == {"0": None, "1": None} and res["cancelled"] == []


def test_rank_0s_ack_proves_this_cancel_now_or_among_its_recent_ones(job):
    def answer(doc):
        ack(job, 0, doc["epoch"], ["cmpl-a"], nonce=doc["nonce"], recent=[(doc["epoch"], doc["nonce"])])
        ack(job, 1, doc["epoch"])

    with Ranks(cancel_path(job.run, job.deployment_id), answer):
        res = run_cancel(job, ["cmpl-a"], 20)
    assert res["all_acked"] and res["cancelled"] == ["cmpl-a"]
    assert {k: a["epoch"] for k, a in res["acks"].items()} == {"0": res["epoch"], "1": res["epoch"]}

    # a newer cancel (rank 0's own abort stage, another operator) overtook ours before we looked: ours is among
    # the recent ones rank 0 applied, and the others acked an epoch at least ours
    def overtaken(doc):
        later = (doc["epoch"] + 1, "cd" * 8)
        ack(job, 0, later[0], ["cmpl-b"], nonce=later[1], recent=[(doc["epoch"], doc["nonce"]), later])
        ack(job, 1, later[0])

    with Ranks(cancel_path(job.run, job.deployment_id), overtaken):
        res = run_cancel(job, ["cmpl-a"], 20)
    assert res["all_acked"] and res["acks"]["0"]["epoch"] == res["epoch"] + 1
    assert res["cancelled"] == []  # what rank 0's ack lists belongs to the newer cancel, not to ours


def test_no_rank_counts_before_rank_0_has_applied_the_cancel(job):
    """Rank 1 acks an epoch at least ours (say, a stale file of a later epoch), rank 0 never answers: nobody
    counts, since the epoch reaches rank 1 only in a meeting after rank 0 applied it."""
    def answer(doc):
        ack(job, 1, doc["epoch"] + 3)

    with Ranks(cancel_path(job.run, job.deployment_id), answer):
        res = run_cancel(job, None, 1.0)
    assert res["all_acked"] is False and res["acks"] == {"0": None, "1": None}


# ---- real ranks ---------------------------------------------------------------------------------------------------

def wait_for(what, check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


@pytest.mark.slow
def test_a_cancel_past_a_file_rank_0_cannot_read_is_applied_and_one_not_applied_never_exits_0(tmp_path, tiny, env):
    dep, host, port = launch_for_long_requests(tmp_path, tiny, env)
    [m] = manifests(tmp_path / "state")
    dep_id, job_id = m["deployment_id"], m["job_id"]
    dirs = sorted({r["runtime_dir"] for r in m["ranks"]})
    log0 = Path(m["ranks"][0]["runtime_dir"]) / f"{m['job_id']}-rank0.log"
    long_body = {"prompt": "def main(argv):", "max_tokens": 3000, "temperature": 0}
    conns = []
    try:
        # 1. an idle deployment: epoch 1, acked by every rank
        first = cli("cancel", dep, "--all", "--wait", "20", "--json", env=env)
        assert first.returncode == 0, first.stderr
        [res] = json.loads(first.stdout)["jobs"]
        assert res["epoch"] == 1 and res["all_acked"]

        # 2. a cancel file no reader takes (over 64 KiB), on every node, as an old CLI wrote for a 70 KB id
        for d in dirs:
            put_whole(Path(d) / f"{m['deployment_id']}-cancel.json", oversized_cancel(dep_id, job_id, 2))
        wait_for("rank 0 to refuse the oversized cancel file",
                 lambda: "ignoring cancel file" in log0.read_text(errors="replace"))

        # 3. a cancel of everything during a stream: a new epoch, above the consumed one; the stream ends
        conn, r = open_stream(host, port, long_body)
        conns.append(conn)
        rid = next_event(r)["id"]  # the first token: it is decoding
        t0 = time.monotonic()
        cn = cli("cancel", dep, "--all", "--wait", "20", "--json", env=env)
        assert cn.returncode == 0, cn.stderr
        [res] = json.loads(cn.stdout)["jobs"]
        assert res["epoch"] == 2 and res["all_acked"] and res["cancelled"] == [rid], cn.stdout
        rest = StreamReader(r).events(20)
        assert rest is not None, "the cancelled stream ran on"
        assert time.monotonic() - t0 < 40  # 3000 tokens take minutes here
        finals = [e for e in rest if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
        assert finals and finals[-1]["choices"][0]["finish_reason"] == "cancelled" and rest[-1] == "[DONE]"

        # 4. nothing left the coordinator can read (cancel files and acks all oversized): its epoch (1) is one
        # rank 0 consumed. Not applied, so not acked: exit 1, the stream runs on, rank 0's log says why.
        for r_ in m["ranks"]:
            put_whole(Path(r_["runtime_dir"]) / f"{dep_id}-rank{r_['rank']}-ack.json",
                      oversized_cancel(dep_id, job_id, 2))
        for d in dirs:
            put_whole(Path(d) / f"{dep_id}-cancel.json", oversized_cancel(dep_id, job_id, 2))
        conn, r = open_stream(host, port, long_body)
        conns.append(conn)
        next_event(r)
        stale = cli("cancel", dep, "--all", "--wait", "3", "--json", env=env)
        assert stale.returncode == 1, stale.stdout + stale.stderr
        doc = json.loads(stale.stdout)
        assert doc["ok"] is False and doc["jobs"][0]["epoch"] == 1 and not doc["jobs"][0]["all_acked"]
        assert "not acked within 3 s by rank 0" in stale.stderr
        for _ in range(3):  # still decoding after the command gave up
            e = next_event(r)
            assert isinstance(e, dict) and e["choices"] and not e["choices"][0]["finish_reason"], e
        wait_for("rank 0 to log the consumed epoch",
                 lambda: "epoch 1 is not above the 2 already consumed" in log0.read_text(errors="replace"))
        assert log0.read_text(errors="replace").count("already consumed") == 1
    finally:
        for c in conns:
            c.close()
        cli("teardown", "--force", env=env)
    assert manifests(tmp_path / "state") == []
