"""The pure part of replan: what is derived from the current deployment, what was given, and the diff."""

from __future__ import annotations

import pytest

from clusterctl.errors import ConfigError, UsageError
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment
from clusterctl.plan.replan import FieldChange, derive, placement_diff

from modelfiles import make_model


def cluster(mem=(64, 128, 192), speeds=None, name="lab"):
    nodes = []
    for i, m in enumerate(mem):
        n = {"name": "abcd"[i], "memory_gb": m, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"],
             "model_path": "/models/m"}
        if speeds:
            n["speed"] = speeds[i]
        nodes.append(n)
    return parse_cluster({"cluster": {"name": name}, "node": nodes})


@pytest.fixture
def facts(tmp_path):
    return inspect_model(make_model(tmp_path / "m32", layers=32, hidden=64))


def plan(facts, c, **opts):
    return make_deployment(c, facts, "/models/m", PlanOptions(**opts), path_map=opts.pop("path_map", None))


def test_nothing_given_derives_everything_and_plans_the_same(facts):
    old = plan(facts, cluster(), allocation="proportional", context=2048)
    ins = derive(old)
    assert set(ins.derived) >= {"cluster", "nodes", "allocation", "backend", "context", "batch", "path_map", "model"}
    assert ins.given == {}
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    d = placement_diff(old, new)
    assert d.unchanged and d.plan_hash_before == d.plan_hash_after and not d.records_changed
    assert all(r.change == "same" for r in d.nodes)


def test_given_allocation_moves_layers_and_the_diff_says_how(facts):
    old = plan(facts, cluster())
    ins = derive(old, options={"allocation": "proportional"})
    assert ins.given == {"allocation": "proportional"} and ins.derived["backend"] == "auto"
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    d = placement_diff(old, new)
    assert not d.unchanged
    by = {r.node: r for r in d.nodes}
    # the old plan's auto is work (the stages overlap): rank 0 gets one layer fewer for the head
    assert by["a"].layers_before == [22, 32] and by["a"].layers_after == [27, 32]
    assert by["a"].change == "moves" and by["a"].memory_after < by["a"].memory_before
    assert FieldChange(field="allocation", before="work", after="proportional") in d.other
    assert any("a" in line and "moves" in line for line in d.lines())


def test_an_auto_allocation_is_resolved_again(facts):
    old = plan(facts, cluster())
    assert (old.options.allocation, old.allocation) == ("auto", "work")
    ins = derive(old, options={"schedule": "lockstep"})
    assert ins.derived["allocation"] == "auto"
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    assert new.allocation == "balanced" and new.options.allocation == "auto"
    assert FieldChange(field="allocation", before="work", after="balanced") in placement_diff(old, new).other


def test_a_node_removed_leaves_and_speeds_travel_with_node_names(facts):
    old = plan(facts, cluster(speeds=[10, 10, 20]), allocation="speed")
    ins = derive(old, nodes=["c", "a"])
    assert ins.given["nodes"] == "c,a" and [n.name for n in ins.cluster.nodes] == ["c", "a"]
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    assert new.speeds == {"c": 20, "a": 10} and [r.layers for r in new.ranks] == [21, 11]
    d = placement_diff(old, new)
    assert {r.node: r.change for r in d.nodes}["b"] == "leaves"
    # a cluster file without speeds: the measured ones are carried by name
    bare = cluster()
    ins2 = derive(old, cluster=bare)
    assert ins2.derived["speeds"] == "a=10,b=10,c=20" and [n.speed for n in ins2.cluster.nodes] == [10, 10, 20]


def test_a_node_can_only_join_from_a_cluster_file(facts):
    old = plan(facts, cluster(mem=(64, 128)))
    with pytest.raises(ConfigError, match="pass --cluster"):
        derive(old, nodes=["a", "b", "c"])
    ins = derive(old, cluster=cluster())
    new = make_deployment(ins.cluster, facts, ins.model_path, ins.options, path_map=ins.path_map)
    d = placement_diff(old, new)
    assert {r.node: r.change for r in d.nodes}["c"] == "joins"
    with pytest.raises(UsageError, match="twice"):
        derive(old, nodes=["a", "a"])


def test_path_map_is_carried_and_an_explicit_empty_one_wins(facts):
    c = cluster()
    old = make_deployment(c, facts, "/models/m", PlanOptions(), path_map={"a": "/fast/m"})
    assert old.path_map["a"] == "/fast/m"
    carried = derive(old)
    assert carried.path_map["a"] == "/fast/m" and "path_map" in carried.derived
    empty = derive(old, path_map={})
    assert empty.path_map == {} and empty.given["path_map"] == "(empty)"
    new = make_deployment(empty.cluster, facts, empty.model_path, empty.options, path_map=empty.path_map)
    d = placement_diff(old, new)
    # the same placement, but node a's ranks would load another folder: another deployment, another id
    assert d.placement_unchanged and not d.unchanged and d.fields_changed == ["path_map"]
    assert new.deployment_id != old.deployment_id
    assert {r.node: (r.path_before, r.path_after) for r in d.nodes}["a"] == ("/fast/m", "/models/m")
    with pytest.raises(ConfigError, match="not among"):
        derive(old, path_map={"z": "/m"})
    with pytest.raises(UsageError, match="not an absolute path"):
        derive(old, path_map={"a": "models/m"})


def test_replan_keeps_the_mode_and_can_change_it(facts):
    two = cluster(mem=(64, 128))
    old = plan(facts, two, parallel="pipeline")
    ins = derive(old)
    assert ins.options.parallel == "pipeline" and "parallel" in ins.derived
    assert make_deployment(ins.cluster, facts, "/models/m", ins.options).parallel == "pipeline"
    ins = derive(old, options={"parallel": "tensor"})
    new = make_deployment(ins.cluster, facts, "/models/m", ins.options, path_map=ins.path_map)
    assert ins.given["parallel"] == "tensor" and new.parallel == "tensor"
    assert any("parallel" in line for line in placement_diff(old, new).lines())
    back = derive(new, options={"parallel": "pipeline"})
    assert make_deployment(back.cluster, facts, "/models/m", back.options, path_map=back.path_map).placement \
        == old.placement
