"""Signed rank contracts: bound to their node, carrying the deployment's proof (not the deployment); ranks refuse
anything else; a contract's size does not grow with the number of nodes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterctl.connect.nodes import Connector
from clusterctl.errors import IntegrityError
from clusterctl.atomic import dumps
from clusterctl.protocol.contract import contract_kind, deployment_proof, encode_contract, load_rank_contract
from clusterctl.protocol.deployment import PlanOptions, encode
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment
from clusterctl.protocol.signing import Keyring, sign_payload

from modelfiles import make_model


@pytest.fixture
def setup(tmp_path):
    model = make_model(tmp_path / "m", layers=8)
    cluster = parse_cluster({"cluster": {"name": "c"}, "node": [
        {"name": "a", "memory_gb": 8, "model_path": str(model)},
        {"name": "b", "memory_gb": 8, "host": "10.0.0.2", "model_path": "/models/on-b"}]})
    dep = make_deployment(cluster, inspect_model(model), str(model), PlanOptions())
    kr = Keyring(tmp_path / "keys")
    key = kr.signing_key()
    run = tmp_path / "run"
    (run / "trusted-keys").mkdir(parents=True)
    (run / "trusted-keys" / "k.pub").write_text(kr.public_keys()[0].to_text())
    return dep, encode(dep, key), key, run, tmp_path


def spec_for(dep, rank: int, run: Path) -> dict:
    r = dep.ranks[rank]
    return {"deployment_id": dep.deployment_id, "job_id": "job1", "nonce": "n", "node": r.node, "rank": rank,
            "world_size": len(dep.ranks), "backend": dep.backend, "model_path": dep.path_map[r.node],
            "start_layer": r.start_layer, "end_layer": r.end_layer, "layer_counts": [x.layers for x in dep.ranks],
            "num_layers": dep.model.num_layers, "hostfile": str(run / "h.json"), "http_port": 8000 if rank == 0 else None,
            "runtime_dir": str(run), "marker_path": str(run / "m.json"), "gate_path": str(run / "g")}


def write(run: Path, data: bytes, name: str = "c.contract") -> Path:
    p = run / name
    p.write_bytes(data)
    return p


def test_valid_contract_gives_the_path_map_entry(setup):
    dep, dep_bytes, key, run, _ = setup
    spec = load_rank_contract(write(run, encode_contract(dep_bytes, spec_for(dep, 1, run), key)), "b")
    assert spec.model_path == "/models/on-b" and (spec.start_layer, spec.end_layer) == (0, 4)


def test_contract_for_another_node_does_not_verify(setup):
    dep, dep_bytes, key, run, _ = setup
    p = write(run, encode_contract(dep_bytes, spec_for(dep, 1, run), key))
    with pytest.raises(IntegrityError, match="signature does not match"):
        load_rank_contract(p, "a")


def test_every_edit_is_refused(setup):
    dep, dep_bytes, key, run, _ = setup
    data = encode_contract(dep_bytes, spec_for(dep, 1, run), key)
    for needle, repl in ((b'"start_layer":0', b'"start_layer":1'), (b"/models/on-b", b"/models/on-x")):
        assert needle in data
        with pytest.raises(IntegrityError):
            load_rank_contract(write(run, data.replace(needle, repl, 1)), "b")


def test_the_launcher_refuses_to_sign_a_spec_its_deployment_does_not_give(setup):
    dep, dep_bytes, key, run, _ = setup
    for field, value, match in (("model_path", "/elsewhere", "path_map"), ("start_layer", 1, "layers"),
                                ("world_size", 3, "world"), ("node", "a", "runs on")):
        spec = spec_for(dep, 1, run)
        spec[field] = value
        with pytest.raises(IntegrityError, match=match):
            encode_contract(dep_bytes, spec, key)


def test_signed_contract_that_disagrees_with_its_deployment_row_is_refused(setup):
    # validly signed (the key holder made it by hand), but the spec is not what its deployment row says
    dep, dep_bytes, key, run, _ = setup
    good = json.loads(encode_contract(dep_bytes, spec_for(dep, 1, run), key).decode())
    good.pop("signature")
    for edit, match in ((lambda d: d["spec"].update(model_path="/elsewhere"), "path_map"),
                        (lambda d: d["deployment"]["assignment"].update(end_layer=5), "layers"),
                        (lambda d: d["deployment"].update(backend="jaccl"), "backend"),
                        (lambda d: d["deployment"].update(id="other"), "names deployment"),
                        (lambda d: d.update(rank=0), "header")):
        doc = json.loads(json.dumps(good))
        edit(doc)
        with pytest.raises(IntegrityError, match=match):
            load_rank_contract(write(run, sign_payload(dumps(doc), contract_kind("b"), key)), "b")


def test_the_front_door_reads_rank_0s_contract_with_the_ranks_reader(setup):
    # one reader (read_contract): what the rank refuses of its contract the front refuses too, and it takes the
    # keys and CORS origins of exactly the spec the rank runs
    import asyncio
    from types import SimpleNamespace

    from clusterctl.front.follow import read_rules
    from clusterctl.plan.inventory import Node
    from clusterctl.statedir.state import StateDir

    dep, dep_bytes, key, run, root = setup
    spec = {**spec_for(dep, 0, run), "api_key": "k" * 32, "cors_origins": ["https://a.example"]}
    good = json.loads(encode_contract(dep_bytes, spec, key).decode())
    good.pop("signature")
    m = SimpleNamespace(job_id="job1", ranks=[SimpleNamespace(node="a", contract_path=str(run / "c.contract"))],
                        nodes=[Node(name="a", local=True)])

    def rules_of(doc: dict):
        write(run, sign_payload(dumps(doc), contract_kind("a"), key))
        return asyncio.run(read_rules(StateDir(root), m, Connector()))

    rules = rules_of(good)
    assert rules.authorized("Bearer " + "k" * 32) and not rules.authorized(None)
    assert rules.cors.headers("https://a.example")
    for edit, match in ((lambda d: d["spec"].update(model_path="/elsewhere"), "path_map"),
                        (lambda d: d["deployment"].update(world_size=3), "world"),
                        (lambda d: d.update(rank=1), "header"),
                        (lambda d: d.update(type="other"), "unknown type"),
                        (lambda d: d.update(job_id="job2") or d["spec"].update(job_id="job2"), "another job")):
        doc = json.loads(json.dumps(good))
        edit(doc)
        with pytest.raises(IntegrityError, match=match):
            rules_of(doc)


def test_contract_carries_the_deployment_proof_not_the_deployment(setup):
    dep, dep_bytes, key, run, _ = setup
    doc = json.loads(encode_contract(dep_bytes, spec_for(dep, 1, run), key).decode())
    sig = json.loads(dep_bytes.decode())["signature"]
    assert doc["deployment"]["sha256"] == hashlib.sha256(dep_bytes).hexdigest()
    assert doc["deployment"]["signature"] == {"key_id": sig["key_id"], "value": sig["value"]}
    assert doc["deployment"]["plan_hash"] == dep.plan_hash and "ranks" not in doc["deployment"]


def test_a_version_1_contract_with_the_deployment_embedded_still_loads(setup):
    dep, dep_bytes, key, run, _ = setup
    spec = spec_for(dep, 1, run)
    doc = {"schema_version": 1, "type": "rank-contract", "node": "b", "rank": 1, "job_id": "job1",
           "deployment_id": dep.deployment_id, "deployment": dep_bytes.decode(), "spec": spec}
    assert load_rank_contract(write(run, sign_payload(dumps(doc), contract_kind("b"), key)), "b").rank == 1
    doc["spec"] = {**spec, "model_path": "/elsewhere"}
    with pytest.raises(IntegrityError, match="path_map"):
        load_rank_contract(write(run, sign_payload(dumps(doc), contract_kind("b"), key)), "b")


def _cluster_of(tmp_path, n: int):
    model = make_model(tmp_path / f"m{n}", layers=256)
    cluster = parse_cluster({"cluster": {"name": "c"}, "node": [
        {"name": f"n{i}", "memory_gb": 8, "host": f"10.0.{i // 250}.{i % 250 + 1}", "model_path": "/models/m"}
        for i in range(n)]})
    return make_deployment(cluster, inspect_model(model), str(model), PlanOptions())


def test_contract_size_does_not_grow_with_the_deployment(setup, tmp_path):
    _, _, key, run, _ = setup
    sizes = {}
    for n in (2, 64):
        dep = _cluster_of(tmp_path, n)
        dep_bytes = encode(dep, key)
        proof = deployment_proof(dep_bytes, dep)
        last = len(dep.ranks) - 1
        spec = spec_for(dep, last, run)
        del spec["layer_counts"]  # as launch writes it: this rank's range, not every rank's count
        data = encode_contract(proof, spec, key)
        got = load_rank_contract(write(run, data, f"c{n}.contract"), dep.ranks[last].node)
        assert got.rank == last and got.layer_counts is None and len(dep.ranks) == n
        assert got.mlx_split[last] == got.end_layer - got.start_layer and sum(got.mlx_split) == 256
        sizes[n] = (len(data), len(dep_bytes))
    assert sizes[64][1] > sizes[2][1] + 30000  # the deployment file grew by tens of KB...
    assert abs(sizes[64][0] - sizes[2][0]) < 16, sizes  # ...the contract did not (a few more digits)


def test_untrusted_key_and_unsigned(setup, tmp_path):
    dep, dep_bytes, key, run, _ = setup
    other = Keyring(tmp_path / "other").signing_key()
    with pytest.raises(IntegrityError, match="unknown key"):
        load_rank_contract(write(run, encode_contract(dep_bytes, spec_for(dep, 1, run), other)), "b")
    with pytest.raises(IntegrityError, match="not signed"):
        load_rank_contract(write(run, json.dumps({"spec": spec_for(dep, 1, run)}).encode()), "b")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tampered", "other-node", "missing"])
def test_the_rank_process_refuses_with_65_and_one_line(setup, how):
    dep, dep_bytes, key, run, _ = setup
    data = encode_contract(dep_bytes, spec_for(dep, 1, run), key)
    if how == "tampered":
        assert b'"rank":1' in data
        data = data.replace(b'"rank":1', b'"rank":0', 1)
    p = write(run, data) if how != "missing" else run / "nope.contract"
    node = "a" if how == "other-node" else "b"
    r = subprocess.run([sys.executable, "-m", "clusterctl.rank", "--contract", str(p), "--node", node],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == (66 if how == "missing" else 65), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
