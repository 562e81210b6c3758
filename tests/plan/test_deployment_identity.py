"""The deployment id names the deployment's identity (issue 30, item 5): what it covers, its check on load, and
files from before it (their id came from plan_hash) — they load, verify, replan and are gone back to."""

import json
from datetime import datetime, timezone

import pytest

from clusterctl.atomic import dumps
from clusterctl.errors import IntegrityError
from clusterctl.protocol.deployment import PlanOptions, decode, deployment_hash, encode, identity_changes
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment
from clusterctl.plan.replan import derive, placement_diff
from clusterctl.protocol.signing import Keyring, sign_payload
from clusterctl.statedir.state import StateDir

from cliutil import run
from modelfiles import make_model
from replanfuzz import _cluster, model_folder

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def cluster(**extra):
    nodes = [{"name": n, "memory_gb": m, "host": f"10.0.0.{i + 1}", "model_path": "/models/m", **extra.get(n, {})}
             for i, (n, m) in enumerate((("a", 64), ("b", 128)))]
    return parse_cluster({"cluster": {"name": "lab"}, "node": nodes})


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return inspect_model(make_model(tmp_path_factory.mktemp("m") / "m", layers=8, hidden=64))


def plan(facts, c=None, path_map=None, **options):
    return make_deployment(c or cluster(), facts, "/models/m", PlanOptions(**options), path_map=path_map, now=NOW)


@pytest.mark.parametrize("change", [
    {"schedule": "lockstep"}, {"prompt_cache_gb": 0.0}, {"prompt_cache_gb": 0.5}, {"context": 2048}, {"batch": 2},
    {"headroom_gb": 1.0}, {"path_map": {"a": "/fast/m"}}, {"cluster": {"a": {"python": "/opt/py/bin/python3"}}},
    {"cluster": {"b": {"runtime_dir": "/var/run/cc"}}}, {"backend": "mpi"}, {"allocation": "proportional"},
])
def test_every_field_that_changes_what_runs_changes_the_id(facts, change):
    base = plan(facts, prompt_cache_gb=0.25)
    change = dict(change)
    c = cluster(**change.pop("cluster")) if "cluster" in change else None
    other = plan(facts, c, change.pop("path_map", None), **{"prompt_cache_gb": 0.25, **change})
    assert other.deployment_id != base.deployment_id and identity_changes(base, other)
    assert placement_diff(base, other).unchanged is False


def test_what_does_not_change_what_runs_keeps_the_id(facts):
    base = plan(facts)
    later = make_deployment(cluster(), facts, "/models/m", PlanOptions())  # another time
    assert later.deployment_id == base.deployment_id and later.created_at != base.created_at
    measured = make_deployment(cluster(a={"speed": 12.5}, b={"speed": 30.0}), facts, "/models/m", PlanOptions(),
                               now=NOW)
    assert measured.deployment_id == base.deployment_id and measured.speeds != base.speeds
    recorded = base.model_copy(update={"model": base.model.model_copy(update={"manifest_hash": "sha256:x"})})
    assert deployment_hash(recorded) == base.deployment_hash
    d = placement_diff(base, measured)
    assert d.unchanged and d.records_changed == ["speeds"]


def test_a_stale_deployment_hash_is_refused_on_load(facts, tmp_path):
    keys = Keyring(tmp_path / "keys")
    dep = plan(facts)
    doc = dep.model_dump(mode="json")
    doc["schedule"] = "lockstep"  # edited by someone holding the key, the hash left as it was
    with pytest.raises(IntegrityError, match="deployment_hash does not match"):
        decode(sign_payload(dumps(doc), "deployment", keys.signing_key()), keys.public_keys())
    assert decode(encode(dep, keys.signing_key()), keys.public_keys()).deployment == dep


def _old_file(dep) -> dict:
    """``dep`` as clusterctl wrote it before the identity hash: no deployment_hash, the id from plan_hash."""
    doc = dep.model_dump(mode="json")
    del doc["deployment_hash"]
    doc["deployment_id"] = f"{dep.cluster}-{dep.plan_hash[:10]}"
    return doc


def test_a_file_from_before_the_identity_hash_loads_keeps_its_id_and_replans(facts, tmp_path):
    st = StateDir(tmp_path / "state")
    doc = _old_file(plan(facts, schedule="overlap"))
    path = st.deployments / f"{doc['deployment_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = sign_payload(dumps(doc), "deployment", st.keyring.signing_key())
    path.write_bytes(data)
    _, loaded = st.load_deployment(doc["deployment_id"])
    old = loaded.deployment
    assert old.deployment_id == doc["deployment_id"] and old.deployment_hash is None and loaded.migrated_from is None
    assert path.read_bytes() == data  # loading never rewrites it
    # nothing given: the same deployment (its identity computed from its fields), whatever its id
    ins = derive(old)
    same = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    assert not identity_changes(old, same) and placement_diff(old, same).unchanged
    # a schedule change: a new deployment, an id of the new kind
    ins = derive(old, options={"schedule": "lockstep"})
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    assert new.deployment_id == f"lab-{new.deployment_hash[:10]}" != old.deployment_id
    assert {"options", "schedule"} <= set(placement_diff(old, new).fields_changed)


def test_replan_of_an_old_file_through_the_cli_and_back(tmp_path):
    """Real files, the real CLI: an old-style file (not running) is replanned to lockstep under a new id and
    brought back with --to to the very same bytes; an unchanged replan of it writes nothing."""
    model = model_folder(tmp_path / "m")
    c = _cluster(tmp_path)
    env = {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state")}
    dep_file = tmp_path / "dep.json"
    r = run("plan", "-c", str(c), "-m", str(model), "--context", "512", "-o", str(dep_file),
            "--json", env=env)
    assert r.code == 0, r.stderr
    st = StateDir(tmp_path / "state")
    planned = st.load_deployment(str(dep_file))[1].deployment
    doc = _old_file(planned)
    old_id = doc["deployment_id"]
    old_bytes = sign_payload(dumps(doc), "deployment", st.keyring.signing_key())
    dep_file.write_bytes(old_bytes)
    r = run("verify", str(dep_file), "--json", env=env)
    assert r.code == 0 and r.json()["deployment_id"] == old_id, r.stderr

    r = run("replan", str(dep_file), "--yes", "--json", env=env)
    assert r.code == 0 and r.json()["action"] == "unchanged" and dep_file.read_bytes() == old_bytes, r.stderr

    r = run("replan", str(dep_file), "--schedule", "lockstep", "--yes", "--json", env=env)
    assert r.code == 0, r.stderr
    out = r.json()
    assert out["action"] == "applied" and out["current"] == old_id and out["new"] != old_id
    assert (st.deployments / f"{old_id}.json").read_bytes() == old_bytes  # the way back, signed in the state dir
    assert json.loads(dep_file.read_bytes())["schedule"] == "lockstep"

    r = run("replan", str(dep_file), "--to", old_id, "--yes", "--json", env=env)
    assert r.code == 0 and r.json()["action"] == "applied", r.stderr
    assert dep_file.read_bytes() == old_bytes
    h = run("history", "--json", env=env).json()["clusters"][0]
    assert [(e["from"], e["to"]) for e in h["entries"]] == [(old_id, out["new"]), (out["new"], old_id)]
