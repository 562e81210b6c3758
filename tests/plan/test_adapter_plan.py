"""``plan --adapter``: the adapter's content is part of the deployment's identity; a bad adapter, or one with
tensor parallelism, is refused in one line."""

import json

import pytest

from adaptermodels import build_adapter
from cliutil import run
from clusters import THREE, write_cluster
from modelfiles import make_model

TWO_FAST = """
[cluster]
name = "lab"
[[node]]
name = "a"
memory_gb = 64
links = [{ peer = "b", type = "thunderbolt", fast = true }]
[[node]]
name = "b"
host = "10.0.0.2"
memory_gb = 64
model_path = "/models/m"
links = [{ peer = "a", type = "thunderbolt", fast = true }]
"""


@pytest.fixture
def c3(tmp_path):
    return write_cluster(tmp_path / "cluster.toml", THREE)


@pytest.fixture
def model(tmp_path):
    return make_model(tmp_path / "m8", layers=8, hidden=64)


@pytest.fixture
def adapter(model, tmp_path):
    return build_adapter(model, tmp_path / "lora", num_layers=4)


def _refused(r, words: str) -> None:
    assert r.code != 0 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and "Traceback" not in r.stderr


def test_the_adapter_is_part_of_the_deployment_and_of_its_id(c3, model, adapter, state):
    base = run("plan", "-c", str(c3), "-m", str(model), "--json").json()
    r = run("plan", "-c", str(c3), "-m", str(model), "--adapter", str(adapter), "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    a = doc["adapter"]
    assert a["manifest_hash"].startswith("sha256:") and (a["num_layers"], a["rank"]) == (4, 4)
    assert a["path_map"]["a"] == str(adapter.resolve())  # the local node reads the coordinator's copy
    assert a["path_map"]["b"] == f"/models/m/.clusterctl-adapters/{a['manifest_hash'][7:23]}"
    assert doc["deployment_id"] != base["deployment_id"] and doc["plan_hash"] == base["plan_hash"]
    other = build_adapter(model, adapter.parent / "lora2", num_layers=4, seed=11)
    doc2 = run("plan", "-c", str(c3), "-m", str(model), "--adapter", str(other), "--json").json()
    assert doc2["deployment_id"] != doc["deployment_id"]  # another adapter's content: another deployment
    assert run("verify", doc["deployment_id"]).code == 0


def test_bad_adapters_are_refused_in_one_line(c3, model, adapter, state, tmp_path):
    def plan(path):
        return run("plan", "-c", str(c3), "-m", str(model), "--adapter", str(path))

    _refused(plan(tmp_path / "nowhere"), "no such folder")
    (adapter / "adapters.safetensors").rename(tmp_path / "kept.safetensors")
    _refused(plan(adapter), "no adapters.safetensors")
    (tmp_path / "kept.safetensors").rename(adapter / "adapters.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "num_layers": 9}))
    _refused(plan(adapter), "num_layers 9 exceeds the model's 8 layers")
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "num_layers": 2}))
    _refused(plan(adapter), "outside the last 2")
    wide = build_adapter(make_model(tmp_path / "wide", layers=8, hidden=128), tmp_path / "wide-lora", num_layers=4)
    _refused(plan(wide), "has shape")
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "fine_tune_type": "full"}))
    _refused(plan(adapter), "not an adapter")


def test_an_adapter_with_tensor_parallelism_is_refused_by_name(model, adapter, state, tmp_path):
    c2 = write_cluster(tmp_path / "two.toml", TWO_FAST)
    assert run("plan", "-c", str(c2), "-m", str(model), "--parallel", "tensor").code == 0
    _refused(run("plan", "-c", str(c2), "-m", str(model), "--parallel", "tensor", "--adapter", str(adapter)),
             "--parallel pipeline")


def test_an_adapter_on_a_quantized_model_is_checked_by_its_linears_real_dimensions(c3, state, tmp_path):
    q = make_model(tmp_path / "q", layers=8, hidden=128, inter=256, quant_bits=4)
    good = build_adapter(q, tmp_path / "q-lora", num_layers=4)
    r = run("plan", "-c", str(c3), "-m", str(q), "--adapter", str(good), "--json")
    assert r.code == 0 and r.json()["adapter"]["num_layers"] == 4, r.stderr
    wide = build_adapter(make_model(tmp_path / "w", layers=8, hidden=64, quant_bits=4), tmp_path / "w-lora",
                         num_layers=4)
    _refused(run("plan", "-c", str(c3), "-m", str(q), "--adapter", str(wide)), "has shape")
