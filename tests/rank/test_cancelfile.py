"""Cancel files as rank 0 reads them: new epochs only, this job only, garbage logged once and ignored."""

from __future__ import annotations

import json
import os

import pytest

from clusterctl.errors import IntegrityError
from clusterctl.rank.cancelfile import (MAX_REQUEST_IDS, REQUEST_ID_PATTERN, CancelWatch, ack_path, cancel_here,
                                          cancel_path, read_ack, read_cancel, write_ack)


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
    assert len(logs) == 3  # each bad file said once, however often it is looked at
    # the rank log explains a cancel that was never applied: its epoch was consumed already
    assert "epoch 2 is not above the 3 already consumed" in logs[0]
    assert "it is for job job-0" in logs[1] and "ignoring cancel file" in logs[2] and "job-0" not in logs[2]
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
    first = json.loads(cancel_path(tmp_path, "dep").read_text())["nonce"]
    assert cancel_here(str(tmp_path), "dep", "job-1", []) == 2
    doc = json.loads(cancel_path(tmp_path, "dep").read_text())
    assert doc["epoch"] == 2 and doc["requests"] == [] and oct(cancel_path(tmp_path, "dep").stat().st_mode)[-3:] == "600"
    assert len(doc["nonce"]) == 16 and doc["nonce"] != first  # each cancel file its own nonce
    write_ack(str(tmp_path), "dep", "job-1", 1, 2, [])
    ack = read_ack(ack_path(tmp_path, "dep", 1))
    assert (ack.rank, ack.epoch, ack.job_id, ack.nonce, ack.recent) == (1, 2, "job-1", None, [])
    write_ack(str(tmp_path), "dep", "job-1", 0, 2, ["cmpl-a"], nonce=doc["nonce"],
              recent=[(e, f"{e:016x}") for e in range(1, 40)])
    ack = read_ack(ack_path(tmp_path, "dep", 0))
    assert ack.shows(2, doc["nonce"]) and not ack.shows(2, first) and not ack.shows(1, doc["nonce"])
    assert len(ack.recent) == 32 and ack.shows(39, f"{39:016x}") and not ack.shows(7, f"{7:016x}")


def test_rank_0s_own_cancel_is_above_what_it_consumed_even_past_a_file_it_cannot_read(tmp_path):
    """The abort stage's cancel must not reuse an epoch rank 0 took: the file on disk may be unreadable."""
    path = cancel_path(tmp_path, "dep")
    path.write_bytes(b"{" + b" " * (70 << 10) + b"}")  # over the 64 KiB a reader accepts
    assert cancel_here(str(tmp_path), "dep", "job-1", ["cmpl-a"], consumed=5) == 6
    w = CancelWatch(str(tmp_path), "dep", "job-1", log=lambda m: None)
    w.consumed = 5
    assert w.poll().epoch == 6


@pytest.mark.parametrize("requests, ok", [
    (["cmpl-6ba95a580fe0f65716a3c08b", "chatcmpl-1", "a.b:c_d-e"], True),
    (["x" * 128], True),
    (["x" * 129], False),
    ([""], False),
    (["a b"], False),
    (["a\n"], False),
    (["../etc/passwd"], False),
    (["é"], False),
    ([f"cmpl-{i}" for i in range(MAX_REQUEST_IDS)], True),
    ([f"cmpl-{i}" for i in range(MAX_REQUEST_IDS + 1)], False),
])
def test_request_ids_are_checked_when_read(tmp_path, requests, ok):
    assert REQUEST_ID_PATTERN.startswith("^") and REQUEST_ID_PATTERN.endswith("$")
    path = cancel_path(tmp_path, "dep")
    write(path, epoch=1, requests=requests)
    if ok:
        assert read_cancel(path).requests == requests
    else:
        with pytest.raises(IntegrityError, match="cancel file .* is invalid: requests"):
            read_cancel(path)


def test_a_consumed_epoch_is_logged_once_unless_it_is_the_same_cancel_written_again(tmp_path):
    logs: list[str] = []
    w = CancelWatch(str(tmp_path), "dep", "job-1", log=logs.append)
    path = cancel_path(tmp_path, "dep")
    write(path, epoch=4, nonce="ab" * 8)
    assert w.poll().epoch == 4
    w.next_at = 0.0
    write(path, epoch=4, nonce="ab" * 8)  # the same cancel again (a second node on this runtime dir): not news
    assert w.poll() is None and logs == []
    for _ in range(2):  # the same epoch from another writer: never applied, said once
        w.next_at = 0.0
        write(path, epoch=4, nonce="cd" * 8)
        assert w.poll() is None
    assert logs == [f"ignoring cancel file {path}: epoch 4 is not above the 4 already consumed"]
    w.next_at = 0.0
    write(path, epoch=5, nonce="cd" * 8)
    assert w.poll().nonce == "cd" * 8
