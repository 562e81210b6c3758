import json
import os
from datetime import datetime, timezone

import pytest

from clusterctl.atomic import dumps
from clusterctl.errors import ConfigError, DoesNotFit, IntegrityError
from clusterctl.protocol.deployment import PlanOptions, decode, encode
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment, replan_same_inputs
from clusterctl.protocol.signing import Keyring, sign_payload, verify_signed
from clusterctl.statedir.state import StateDir

from modelfiles import make_model

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def cluster(mem=(64, 128, 192), **extra):
    nodes = []
    for i, m in enumerate(mem):
        n = {"name": "abcdefgh"[i], "memory_gb": m, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"],
             "model_path": "/models/m"}
        n.update(extra.get(n["name"], {}))
        nodes.append(n)
    return parse_cluster({"cluster": {"name": "lab"}, "node": nodes})


@pytest.fixture
def facts(tmp_path):
    return inspect_model(make_model(tmp_path / "m32", layers=32, hidden=64))


def test_golden_balanced_plan_hash(facts):
    # Pinned: adding allocation modes, fields or options must never change a balanced plan's hash.
    dep = make_deployment(cluster(), facts, "/models/m", PlanOptions(allocation="balanced"), now=NOW)
    assert [(r.start_layer, r.end_layer) for r in dep.ranks] == [(21, 32), (10, 21), (0, 10)]
    assert dep.plan_hash == GOLDEN_BALANCED
    # the id names the deployment's identity (placement and everything else it runs with), not the placement alone;
    # changed on 2026-12-05 (issue 30: the id was plan_hash's, so a schedule or path change overwrote the old file)
    assert dep.deployment_hash == GOLDEN_BALANCED_IDENTITY
    assert dep.deployment_id == "lab-" + GOLDEN_BALANCED_IDENTITY[:10]


# changed once on 2026-12-04: the fixture's config.json gained what mlx-lm needs to build the class (rms_norm_eps,
# rope_theta), which changes the model's facts hash, not the way a plan is hashed
GOLDEN_BALANCED = "3ea37ff5f4b14afbcb321285343054710a710f16346cdad3c22701f35f8b7d7c"
GOLDEN_BALANCED_IDENTITY = "743f2c82e369deabb8ca55307e04214ccca5d078bc00c687da8ba1d3217a42f6"


def test_proportional_plan(facts):
    dep = make_deployment(cluster(), facts, "/models/m", PlanOptions(allocation="proportional"), now=NOW)
    assert [r.layers for r in dep.ranks] == [5, 11, 16]
    assert [(r.start_layer, r.end_layer) for r in dep.ranks] == [(27, 32), (16, 27), (0, 16)]
    assert dep.backend == "ring"


def test_path_map_does_not_change_the_plan_hash(facts):
    a = make_deployment(cluster(), facts, "/models/m", PlanOptions(), now=NOW)
    b = make_deployment(cluster(), facts, "/elsewhere/m", PlanOptions(), path_map={"a": "/x", "b": "/y", "c": "/z"})
    assert a.plan_hash == b.plan_hash and a.path_map != b.path_map


def test_speed_allocation(facts):
    c = cluster(a={"speed": 10}, b={"speed": 10}, c={"speed": 20})
    dep = make_deployment(c, facts, "/m", PlanOptions(allocation="speed"))
    assert [r.layers for r in dep.ranks] == [8, 8, 16]
    with pytest.raises(ConfigError, match="missing on a, b, c"):
        make_deployment(cluster(), facts, "/m", PlanOptions(allocation="speed"))


def test_does_not_fit_names_node_and_numbers(facts):
    with pytest.raises(DoesNotFit) as e:
        make_deployment(cluster(mem=(0.4, 128, 192)), facts, "/m", PlanOptions(context=100_000))
    msg = e.value.message
    assert "node a needs" in msg and "usable" in msg and "node b" not in msg
    assert e.value.exit_code == 78


def test_does_not_fit_breakdown_adds_up_with_the_prompt_cache(facts):
    """Every term of what a rank needs is in the line (issue 30: the prompt cache's reserve was left out, so the
    parts did not add up to the total)."""
    import re

    with pytest.raises(DoesNotFit) as e:
        make_deployment(cluster(mem=(1.0, 128, 192)), facts, "/m", PlanOptions(prompt_cache_gb=0.75, batch=1))
    msg = e.value.message
    m = re.search(r"needs ([\d.]+) GiB \(weights ([\d.]+) GiB \+ KV ([\d.]+) GiB \+ headroom ([\d.]+) GiB "
                  r"\+ prompt cache ([\d.]+) GiB\)", msg)
    assert m, msg
    total, *parts = map(float, m.groups())
    assert parts[3] == 0.75 and abs(sum(parts) - total) < 0.011, msg
    assert "--prompt-cache-gb" in e.value.hint


def test_kv_counts_context_and_batch(facts):
    one = make_deployment(cluster(), facts, "/m", PlanOptions(context=1000, batch=1))
    four = make_deployment(cluster(), facts, "/m", PlanOptions(context=1000, batch=4))
    assert four.ranks[0].planned.kv == 4 * one.ranks[0].planned.kv
    r = one.ranks[0]
    assert r.planned.kv == facts.kv_bytes_per_token_per_layer * r.layers * 1000
    # every pipeline rank holds embedding + head
    assert all(x.planned.weights >= facts.shared_bytes for x in one.ranks)


def test_batch_slots_default_to_as_many_as_fit_up_to_eight_and_more_are_refused(facts):
    kv1 = facts.kv_bytes_per_token_per_layer * 11 * 1000  # rank 0 holds 11 layers of the balanced split
    big = make_deployment(cluster(), facts, "/m", PlanOptions(context=1000, allocation="balanced"))
    assert big.batch == 8 and big.options.batch is None and big.slots is not None and big.slots > 8
    assert big.ranks[0].planned.kv == 8 * kv1
    # node a with room for exactly 3 slots (weights + headroom + 3 x KV, a few bytes spare)
    r = big.ranks[0]
    room = r.planned.weights + r.planned.headroom + 3 * kv1 + 100
    frac = cluster().nodes[0].usable_bytes / (64 << 30)  # the usable share of memory_gb
    tight = cluster(mem=(room / frac / (1 << 30), 128, 192))
    usable = tight.nodes[0].usable_bytes
    want = (usable - r.planned.weights - r.planned.headroom) // kv1
    assert 2 <= want < 8
    auto = make_deployment(tight, facts, "/m", PlanOptions(context=1000, allocation="balanced"))
    assert auto.slots == want and auto.batch == min(8, want) >= 1
    assert auto.ranks[0].planned.total <= usable
    with pytest.raises(DoesNotFit, match="node a needs"):
        make_deployment(tight, facts, "/m", PlanOptions(context=1000, allocation="balanced", batch=want + 1))
    exact = make_deployment(tight, facts, "/m", PlanOptions(context=1000, allocation="balanced", batch=want))
    assert exact.batch == want


def test_backend_rules(facts):
    with pytest.raises(ConfigError) as e:
        make_deployment(cluster(), facts, "/m", PlanOptions(backend="jaccl"))
    assert "jaccl: node a has no rdma link to node b" in e.value.message
    links = {
        "a": {"links": [{"peer": "b", "rdma": True, "device": "rdma_en3"}, {"peer": "c", "rdma": True, "device": "rdma_en4"}]},
        "b": {"links": [{"peer": "a", "rdma": True, "device": "rdma_en3"}, {"peer": "c", "rdma": True, "device": "rdma_en4"}]},
        "c": {"links": [{"peer": "a", "rdma": True, "device": "rdma_en3"}, {"peer": "b", "rdma": True, "device": "rdma_en4"}]},
    }
    assert make_deployment(cluster(**links), facts, "/m", PlanOptions(backend="auto")).backend == "jaccl"
    partial = dict(links)
    partial["c"] = {"links": [{"peer": "a", "rdma": True, "device": "x"}]}  # c -> b unknown: fail closed
    assert make_deployment(cluster(**partial), facts, "/m", PlanOptions(backend="auto")).backend == "ring"
    assert make_deployment(cluster(), facts, "/m", PlanOptions(backend="mpi")).backend == "mpi"


def _two(c):
    return c.model_copy(update={"nodes": c.nodes[:2]})


def test_tensor_parallel_rules(facts):
    with pytest.raises(ConfigError, match="pipeline-only"):
        make_deployment(cluster(), facts, "/m", PlanOptions(parallel="tensor", allocation="proportional"))
    dep = make_deployment(_two(cluster()), facts, "/m", PlanOptions(parallel="tensor"))
    assert all((r.start_layer, r.end_layer) == (0, 32) for r in dep.ranks)
    assert any("known-fast links" in w for w in dep.warnings)
    # 4 heads, 2 KV heads, 128 intermediate: not over 3 ranks, whatever the operator asks
    with pytest.raises(ConfigError, match="cannot shard model type 'qwen2' over 3 ranks: 4 attention heads do not "
                                          "divide by 3 ranks; 2 KV heads do not divide by 3 ranks"):
        make_deployment(cluster(), facts, "/m", PlanOptions(parallel="tensor"))


def test_parallel_auto_takes_tensor_only_over_fast_links_and_even_shards(facts):
    fast = {n: {"links": [{"peer": p, "type": "thunderbolt"} for p in "abc" if p != n]} for n in "abc"}
    dep = make_deployment(_two(cluster(**fast)), facts, "/m", PlanOptions())
    assert dep.parallel == "tensor" and dep.options.parallel == "auto" and dep.parallel_reason.startswith("tensor:")
    dep = make_deployment(_two(cluster()), facts, "/m", PlanOptions())
    assert dep.parallel == "pipeline" and "fast link" in dep.parallel_reason
    dep = make_deployment(cluster(**fast), facts, "/m", PlanOptions())  # 3 ranks: 4 heads do not divide
    assert dep.parallel == "pipeline" and "do not divide by 3" in dep.parallel_reason
    dep = make_deployment(_two(cluster(**fast)), facts, "/m", PlanOptions(allocation="proportional"))
    assert dep.parallel == "pipeline" and "proportional" in dep.parallel_reason


def test_allocation_auto_is_work_when_the_stages_overlap_else_balanced(facts):
    fast = {n: {"links": [{"peer": p, "type": "thunderbolt"} for p in "abc" if p != n]} for n in "abc"}
    dep = make_deployment(cluster(), facts, "/m", PlanOptions())
    assert (dep.schedule, dep.allocation, dep.options.allocation) == ("overlap", "work", "auto")
    assert "slowest sets the pace" in dep.allocation_reason
    assert dep.model.layer_work == facts.layer_work and dep.model.head_work == facts.head_work
    assert [r.layers for r in dep.ranks] == [10, 11, 11]  # the head weighs less than a layer here
    lockstep = make_deployment(cluster(), facts, "/m", PlanOptions(schedule="lockstep"))
    assert lockstep.allocation == "balanced" and "lockstep" in lockstep.allocation_reason
    assert [r.layers for r in lockstep.ranks] == [11, 11, 10]
    tensor = make_deployment(_two(cluster(**fast)), facts, "/m", PlanOptions())
    assert (tensor.parallel, tensor.allocation) == ("tensor", "balanced")
    asked = make_deployment(cluster(), facts, "/m", PlanOptions(allocation="work", schedule="lockstep"))
    assert asked.allocation == "work" and asked.allocation_reason == "asked for"
    with pytest.raises(ConfigError, match="--allocation work is pipeline-only"):
        make_deployment(_two(cluster()), facts, "/m", PlanOptions(parallel="tensor", allocation="work"))
    assert make_deployment(_two(cluster(**fast)), facts, "/m", PlanOptions(allocation="work")).parallel == "pipeline"


def test_work_allocation_of_a_smollm2_shape(tmp_path):
    # SmolLM2-135M's figures (30 blocks of 3.54M logical parameters, a tied head of 28.3M) on two nodes
    f = inspect_model(make_model(tmp_path / "m30", layers=30, hidden=64))
    f = f.model_copy(update={"layer_work": [3_540_096] * 30, "head_work": 28_311_552})
    dep = make_deployment(_two(cluster()), f, "/m", PlanOptions())
    assert [(r.start_layer, r.end_layer) for r in dep.ranks] == [(19, 30), (0, 19)]
    # facts without work figures: balanced, saying why
    bare = make_deployment(_two(cluster()), f.model_copy(update={"layer_work": [], "head_work": 0}), "/m",
                           PlanOptions())
    assert bare.allocation == "balanced" and "no per-layer work" in bare.allocation_reason
    assert [r.layers for r in bare.ranks] == [15, 15]


def test_the_launch_recheck_keeps_the_recorded_work_and_allocation(facts):
    # planned with mlx-lm's own (lockstep) pipeline; the launch re-check does not build the class (pipeline None)
    dep = make_deployment(cluster(), facts.model_copy(update={"pipeline": "mlx-lm"}), "/m", PlanOptions())
    assert (dep.schedule, dep.allocation) == ("lockstep", "balanced")
    bare = facts.model_copy(update={"pipeline": None, "model_class": None})
    assert replan_same_inputs(dep, bare).plan_hash == dep.plan_hash
    # a newer work estimate of the same model never moves an approved placement
    dep = make_deployment(cluster(), facts, "/m", PlanOptions())
    heavier = facts.model_copy(update={"head_work": 100 * facts.head_work})
    assert make_deployment(cluster(), heavier, "/m", PlanOptions()).plan_hash != dep.plan_hash
    assert replan_same_inputs(dep, heavier).plan_hash == dep.plan_hash


def test_a_file_from_before_work_figures_loads_and_replans_the_same(facts, tmp_path):
    st = StateDir(tmp_path / "state")
    dep = make_deployment(cluster(), facts, "/models/m", PlanOptions(allocation="balanced"), now=NOW)
    doc = dep.model_dump(mode="json")
    for key in ("layer_work", "head_work"):
        del doc["model"][key]
    del doc["allocation_reason"]
    del doc["deployment_hash"]  # files from before work figures predate the identity hash too
    f = tmp_path / "old.json"
    f.write_bytes(_resign(doc, st.keyring.signing_key()))
    old = st.load_deployment(str(f))[1].deployment
    assert old.model.layer_work == [] and old.allocation_reason is None
    assert replan_same_inputs(old, facts).plan_hash == dep.plan_hash


def test_pipeline_support_comes_from_the_class_mlx_lm_builds(tmp_path):
    f = inspect_model(make_model(tmp_path / "llama", layers=8, model_type="llama"))
    assert f.model_class == "mlx_lm.models.llama.Model" and f.pipeline == "stages"
    assert make_deployment(cluster(), f, "/m", PlanOptions()).parallel == "pipeline"
    f = inspect_model(make_model(tmp_path / "mistral", layers=8, model_type="mistral"))  # mlx-lm maps it to llama
    assert f.model_class == "mlx_lm.models.llama.Model" and f.pipeline == "stages"
    f = inspect_model(make_model(tmp_path / "odd", layers=8, model_type="no_such_architecture"))
    assert f.pipeline is None
    with pytest.raises(ConfigError, match="cannot split model type 'no_such_architecture' over 3 nodes: mlx-lm "
                                          "cannot build this model"):
        make_deployment(cluster(), f, "/m", PlanOptions())
    one = cluster()
    one = one.model_copy(update={"nodes": one.nodes[:1]})
    assert make_deployment(one, f, "/m", PlanOptions()).ranks[0].layers == 8  # one node needs no split


def test_a_hybrid_with_state_caches_and_no_pipeline_of_its_own_plans_on_the_stage_code(tmp_path):
    """Bailing V3 (model_type bailing_hybrid, mlx-lm's bailing_moe_v3 class): linear-attention layers keep an
    ArraysCache and the class has no pipeline(), so mlx-lm cannot split it; the stage code can (its skipped state
    layers keep their caches' bookkeeping). mlx-lm has no shard() for it: tensor parallel is refused, naming why,
    and --parallel auto takes pipeline even over fast links."""
    from archmodels import build

    f = inspect_model(build("bailing_hybrid", tmp_path / "bailing", None))
    assert (f.model_class, f.pipeline, f.shardable) == ("mlx_lm.models.bailing_moe_v3.Model", "stages", False)
    assert [k.kind for k in f.kv_layers] == ["linear", "mla", "linear", "mla"]
    dep = make_deployment(_two(cluster()), f, "/m", PlanOptions(parallel="pipeline"))
    assert dep.schedule == "overlap" and [r.layers > 0 for r in dep.ranks] == [True, True]
    with pytest.raises(ConfigError, match="cannot shard model type 'bailing_hybrid' over 2 ranks: mlx-lm's "
                                          r"mlx_lm.models.bailing_moe_v3.Model cannot shard itself \(no shard\(\)\)"
                       ) as refused:
        make_deployment(_two(cluster()), f, "/m", PlanOptions(parallel="tensor"))
    assert refused.value.hint == "use --parallel pipeline"  # no number of nodes would do
    fast = {n: {"links": [{"peer": p, "type": "thunderbolt"} for p in "ab" if p != n]} for n in "ab"}
    dep = make_deployment(_two(cluster(**fast)), f, "/m", PlanOptions())
    assert dep.parallel == "pipeline" and "no shard()" in dep.parallel_reason


# ---- signing -------------------------------------------------------------------------------------------------------

@pytest.fixture
def keys(tmp_path):
    kr = Keyring(tmp_path / "keys")
    return kr.signing_key(), kr


def test_key_created_0600(keys):
    _, kr = keys
    assert oct(os.stat(kr.private_path).st_mode & 0o777) == "0o600"
    assert kr.public_keys()[0].raw == keys[0].public.raw
    assert "PRIVATE" not in repr(keys[0])


def test_roundtrip_and_every_byte_is_covered(facts, keys):
    sk, kr = keys
    dep = make_deployment(cluster(), facts, "/m", PlanOptions(), now=NOW)
    data = encode(dep, sk)
    assert decode(data, kr.public_keys()).deployment == dep
    # flip a sample of bytes everywhere in the file: each edit must be refused with exit 65
    step = max(1, len(data) // 300)
    for i in range(0, len(data), step):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(IntegrityError) as e:
            decode(bytes(bad), kr.public_keys())
        assert e.value.exit_code == 65


def test_unsigned_unknown_key_and_wrong_type(facts, keys, tmp_path):
    sk, kr = keys
    dep = make_deployment(cluster(), facts, "/m", PlanOptions(), now=NOW)
    payload = dumps(dep.model_dump(mode="json"))
    with pytest.raises(IntegrityError, match="is not signed"):
        decode(payload, kr.public_keys())
    other = Keyring(tmp_path / "other").signing_key()
    with pytest.raises(IntegrityError, match="unknown key"):
        decode(encode(dep, other), kr.public_keys())
    with pytest.raises(IntegrityError, match="no trusted public key"):
        decode(encode(dep, sk), [])
    # a validly signed file of another type never passes as a deployment
    cancel = sign_payload(dumps({"type": "cancel", "deployment_id": dep.deployment_id, "epoch": 1}), "cancel", sk)
    assert verify_signed(cancel, "cancel", kr.public_keys())
    with pytest.raises(IntegrityError, match="signature does not match"):
        decode(cancel, kr.public_keys())


def _resign(doc, sk):
    return sign_payload(dumps(doc), "deployment", sk)


def test_v1_migrates_on_disk(facts, tmp_path, monkeypatch):
    st = StateDir(tmp_path / "state")
    sk = st.keyring.signing_key()
    dep = make_deployment(cluster(), facts, "/models/m", PlanOptions(), now=NOW)
    doc = dep.model_dump(mode="json")
    doc["schema_version"] = 1
    del doc["path_map"]
    del doc["deployment_hash"]
    doc["model"]["path"] = "/models/m"
    del doc["model"]["source_path"]
    for n in doc["nodes"]:
        n["model_path"] = None
    f = tmp_path / "old.json"
    f.write_bytes(_resign(doc, sk))
    path, loaded = st.load_deployment(str(f))
    assert loaded.migrated_from == 1
    assert loaded.deployment.path_map == {"a": "/models/m", "b": "/models/m", "c": "/models/m"}
    assert loaded.deployment.plan_hash == dep.plan_hash
    on_disk = json.loads(f.read_bytes())
    assert on_disk["schema_version"] == 2 and "path_map" in on_disk
    _, again = st.load_deployment(str(f))
    assert again.migrated_from is None


def test_newer_version_refused_and_kept(facts, tmp_path):
    st = StateDir(tmp_path / "state")
    sk = st.keyring.signing_key()
    doc = make_deployment(cluster(), facts, "/m", PlanOptions(), now=NOW).model_dump(mode="json")
    doc["schema_version"] = 3
    st.deployments.mkdir(parents=True)
    f = st.deployments / "future.json"
    f.write_bytes(_resign(doc, sk))
    with pytest.raises(IntegrityError, match="schema_version 3"):
        st.load_deployment("future")
    assert f.exists()


def test_corrupt_state_file_moved_aside(facts, tmp_path):
    st = StateDir(tmp_path / "state")
    dep = make_deployment(cluster(), facts, "/m", PlanOptions(), now=NOW)
    [p] = st.save_deployment(dep)
    good = p.read_bytes()
    p.write_bytes(good[: len(good) // 2])
    with pytest.raises(IntegrityError, match="moved aside"):
        st.load_deployment(dep.deployment_id)
    assert not p.exists()
    aside = list(st.deployments.glob(f"{p.name}.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == good[: len(good) // 2]


def test_replan_detects_changed_model(facts, tmp_path):
    dep = make_deployment(cluster(), facts, str(tmp_path / "m32"), PlanOptions(), now=NOW)
    assert replan_same_inputs(dep, facts).plan_hash == dep.plan_hash
    changed = inspect_model(make_model(tmp_path / "m32b", layers=32, hidden=64, inter=256))
    from clusterctl.protocol.deployment import diff_placement

    new = replan_same_inputs(dep, changed)
    assert new.plan_hash != dep.plan_hash
    assert any("facts hash differs" in line for line in diff_placement(dep, new))


def test_a_signed_file_under_another_deployments_name_is_refused(facts, tmp_path):
    st = StateDir(tmp_path / "state")
    a = make_deployment(cluster(), facts, "/m", PlanOptions(allocation="balanced"), now=NOW)
    [p] = st.save_deployment(a)
    (st.deployments / "lab-other.json").write_bytes(p.read_bytes())
    with pytest.raises(IntegrityError, match="not lab-other"):
        st.load_deployment("lab-other")


def test_embedding_offload_planning(tmp_path):
    f = inspect_model(make_model(tmp_path / "big-vocab", layers=4, hidden=64, vocab=20000))
    assert f.embed_bytes == 20000 * 64 * 2
    c = parse_cluster({"cluster": {"name": "lab"}, "node": [{"name": "a", "memory_gb": 1}]})
    off = make_deployment(c, f, "/m", PlanOptions(context=16, headroom_gb=0))
    on = make_deployment(c, f, "/m", PlanOptions(context=16, headroom_gb=0, embedding_offload="on"))
    assert off.ranks[0].planned.weights - on.ranks[0].planned.weights == f.embed_bytes
    assert on.embedding_offload and not off.embedding_offload and on.plan_hash == off.plan_hash
    # auto: only when the table would not fit otherwise
    assert not make_deployment(c, f, "/m", PlanOptions(context=16, embedding_offload="auto")).embedding_offload
    need_without = off.ranks[0].planned.total
    tight = parse_cluster({"cluster": {"name": "lab"}, "node": [
        {"name": "a", "memory_gb": (need_without - f.embed_bytes // 2) / 2**30, "usable_fraction": 1.0}]})
    with pytest.raises(DoesNotFit):
        make_deployment(tight, f, "/m", PlanOptions(context=16, headroom_gb=0))
    auto = make_deployment(tight, f, "/m", PlanOptions(context=16, headroom_gb=0, embedding_offload="auto"))
    assert auto.embedding_offload and any("served from SSD" in w for w in auto.warnings)
    tied = inspect_model(make_model(tmp_path / "tied", layers=4, tie=True))
    with pytest.raises(ConfigError, match="untied lm_head"):
        make_deployment(c, tied, "/m", PlanOptions(embedding_offload="on"))


def test_a_model_mlx_lm_cannot_batch_is_planned_one_request_at_a_time(tmp_path):
    import json

    folder = make_model(tmp_path / "g2", layers=4, model_type="gemma2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "head_dim": 16, "query_pre_attn_scalar": 16}))
    f = inspect_model(folder)
    assert f.batchable is False and "cannot be broadcast" in f.batch_reason  # tried on a toy-size gemma2
    dep = make_deployment(cluster(), f, "/m", PlanOptions())
    assert dep.batch == 1 and any("one request at a time" in w for w in dep.warnings)
    with pytest.raises(ConfigError, match="--batch 4: mlx-lm cannot decode several requests"):
        make_deployment(cluster(), f, "/m", PlanOptions(batch=4))
    assert inspect_model(make_model(tmp_path / "q", layers=4)).batchable is True
