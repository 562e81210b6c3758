"""The heal file (statedir/healfile.py): one model, SupervisorState, read back from what the supervisor wrote
before it was a model, written in the same shape (docs/heal.md, "The state file")."""

from __future__ import annotations

import json

from clusterctl.statedir import healfile
from clusterctl.statedir.healfile import SupervisorState
from clusterctl.statedir.state import StateDir

# docs/heal.md's example, as the dict-writing supervisor wrote it (issue 50: before the model)
OLD = {"schema_version": 1, "state": "serving", "reason": "on a; b lost, probed for the rejoin",
       "since": "2026-12-05T12:00:12Z", "heals": 1, "degraded_seconds": 0.0, "deployment": "t-6a2f01c9e3",
       "job": "t-6a2f01c9e3-20261205120007-1b2c3d", "cluster": "t", "original": "t-0b1e7d44a2", "lost_nodes": ["b"],
       "http_host": "0.0.0.0", "http_port": 27570, "leaving_out": None,
       "supervisor": {"host": "ops", "pid": 4242, "start_time": 1796443200.12, "boot_id": "x", "detached": False},
       "updated_at": "2026-12-05T12:00:13Z"}


def test_a_file_the_old_supervisor_wrote_loads_and_is_written_back_in_its_shape(tmp_path):
    state = StateDir(tmp_path)
    path = healfile.path_of(state, "t")
    path.parent.mkdir()
    path.write_text(json.dumps(OLD))
    s = healfile.read(path)
    assert (s.state, s.lost_nodes, s.http_port, s.supervisor.pid) == ("serving", ["b"], 27570, 4242)
    healfile.write(state, s)
    assert json.loads(path.read_text()) == OLD and list(json.loads(path.read_text())) == list(OLD)


def test_an_older_file_loads_with_defaults_and_what_a_reader_cannot_read_is_unknown(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"state": "degraded", "deployment": "d", "http_port": True, "supervisor": [1],
                                "added_later": {"by": "a newer supervisor"}}))
    s = healfile.read(path)
    assert (s.heals, s.lost_nodes, s.leaving_out, s.http_port, s.supervisor) == (0, [], None, None, None)
    assert s.supervisor_alive() is None
    for port in (0, 65536, 27570.0, "27570"):
        path.write_text(json.dumps({"state": "serving", "deployment": "d", "http_port": port}))
        assert healfile.read(path).http_port is None, port


def test_every_supervision_names_its_deployment(tmp_path):
    """``read_all`` (status, teardown, reap): only files that name what runs; the front door reads the rest too."""
    state = StateDir(tmp_path)
    healfile.write(state, SupervisorState(state="serving", deployment="d", cluster="a"))
    healfile.write(state, SupervisorState(state="healing", cluster="b"))
    assert [s.cluster for s in healfile.read_all(state)] == ["a"]
    assert healfile.read_state(state, "b").state == "healing"
