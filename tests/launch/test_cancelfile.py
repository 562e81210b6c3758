"""Cancel files as rank 0 reads them: new epochs only, this job only, garbage logged once and ignored."""

from __future__ import annotations

import json
import os

from clusterctl.launch.cancelfile import (CancelWatch, ack_path, cancel_here, cancel_path, read_ack, write_ack)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def write(path, **doc):
    base = {"schema_version": 1, "type": "cancel", "deployment_id": "dep", "job_id": "job-1", "epoch": 1,
            "requests": None, "created_at": 1.0}
    base.update(doc)
    path.write_text(json.dumps(base))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a visible change even within one tick


def test_new_epochs_of_this_job_only(tmp_path):
    logs: list[str] = []
    clock = Clock()
    w = CancelWatch(str(tmp_path), "dep", "job-1", log=logs.append, clock=clock, every=0.2)
    path = cancel_path(tmp_path, "dep")
    assert w.poll() is None  # no file
    write(path, epoch=3, requests=["cmpl-a"])
    assert w.poll() is None  # looked 0.0 s ago: throttled
    clock.t += 0.2
    doc = w.poll()
    assert doc is not None and doc.epoch == 3 and doc.requests == ["cmpl-a"]
    clock.t += 0.2
    assert w.poll() is None  # consumed
    write(path, epoch=2)  # an older epoch written later: ignored
    clock.t += 0.2
    assert w.poll() is None
    write(path, epoch=4, job_id="job-0")  # another job's file
    clock.t += 0.2
    assert w.poll() is None
    clock.t += 0.2
    assert w.poll() is None
    path.write_text('{"schema_version": 1, "type": "cancel", "epoch": ')  # garbage
    clock.t += 0.2
    assert w.poll() is None
    clock.t += 0.2
    assert w.poll() is None
    assert len(logs) == 2  # each bad file said once, however often it is looked at
    assert "it is for job job-0" in logs[0] and "ignoring cancel file" in logs[1] and "job-0" not in logs[1]
    write(path, epoch=5)
    clock.t += 0.2
    assert w.poll().epoch == 5


def test_a_changed_file_is_seen_by_a_stat_and_read_by_the_next_poll_at_once(tmp_path):
    clock = Clock()
    w = CancelWatch(str(tmp_path), "dep", "job-1", log=lambda m: None, clock=clock, every=0.2)
    path = cancel_path(tmp_path, "dep")
    assert not w.changed()  # no file
    assert w.poll() is None
    write(path, epoch=1)
    assert w.changed()  # what an idle rank 0 asks between meetings
    assert w.poll().epoch == 1  # not throttled: read at once
    assert not w.changed()  # seen
    write(path, epoch=2, job_id="job-0")  # another job's file: one look, then quiet
    assert w.changed()
    assert w.poll() is None
    assert not w.changed()


def test_rank_0s_own_cancel_names_its_requests_and_acks_round_trip(tmp_path):
    assert cancel_here(str(tmp_path), "dep", "job-1", ["cmpl-a"]) == 1
    assert cancel_here(str(tmp_path), "dep", "job-1", []) == 2
    doc = json.loads(cancel_path(tmp_path, "dep").read_text())
    assert doc["epoch"] == 2 and doc["requests"] == [] and oct(cancel_path(tmp_path, "dep").stat().st_mode)[-3:] == "600"
    write_ack(str(tmp_path), "dep", "job-1", 1, 2, [])
    ack = read_ack(ack_path(tmp_path, "dep", 1))
    assert (ack.rank, ack.epoch, ack.job_id) == (1, 2, "job-1")
