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


# (what the config says, words of the refusal): each one planned with exit 0 on 5b99778 (or crashed, or blocked),
# and would serve something other than what it says (the base model, an infinite scale) or nothing at all
CONFIG_CASES = [
    ({"lora_parameters": {"scale": "INF"}}, "not valid JSON"),  # the text Infinity (json.dumps of inf)
    ({"lora_parameters": {"scale": "NAN"}}, "not valid JSON"),
    ({"lora_parameters": {"scale": 0}}, "lora_parameters.scale 0 is not"),
    ({"lora_parameters": {"scale": "20"}}, "lora_parameters.scale 20 is not"),
    ({"lora_parameters": {"rank": 0}}, "lora_parameters.rank 0 is not"),
    ({"lora_parameters": {"rank": -4}}, "lora_parameters.rank -4 is not"),
    ({"lora_parameters": {"rank": True}}, "lora_parameters.rank True is not"),
    ({"lora_parameters": {"dropout": 1.5}}, "lora_parameters.dropout 1.5"),
    ({"lora_parameters": {"keys": ["self_attn.nope"]}}, "keys names 'self_attn.nope'"),
    ({"lora_parameters": {"keys": ["input_layernorm"]}}, "keys names 'input_layernorm'"),
    ({"lora_parameters": {"keys": ["self_attn.q_proj"]}}, "which lora_parameters.keys does not name"),
    ({"lora_parameters": {"keys": "self_attn.q_proj"}}, "keys must be a non-empty list"),
    ({"num_layers": 0}, "num_layers 0 is not"),
    ({"num_layers": 10**12}, "num_layers 1000000000000 exceeds"),
    ({"num_layers": "4"}, "num_layers 4 is not"),
    ({"num_layers": 8}, "has no weights for model.layers.0."),  # LoRA layers the ranks would find no weights for
    ({"fine_tune_type": "dora"}, "has no m for"),
    ({"fine_tune_type": ["lora"]}, "is not an adapter"),
]


def _with(cfg: dict, change: dict) -> str:
    out = {**cfg, **{k: v for k, v in change.items() if k != "lora_parameters"}}
    out["lora_parameters"] = {**cfg["lora_parameters"], **change.get("lora_parameters", {})}
    text = json.dumps(out)
    return text.replace('"INF"', "Infinity").replace('"NAN"', "NaN")


def _inspect_refused(adapter, model, words: str) -> None:
    """The planner's check itself (what `plan --adapter` runs: 10 ms, not a whole plan's 200)."""
    from clusterctl.errors import ConfigError
    from clusterctl.plan.adapter import inspect_adapter

    with pytest.raises(ConfigError) as e:
        inspect_adapter(adapter, model, 8, {"a": (str(model), True)})
    assert words in e.value.message and "\n" not in e.value.message, e.value.message


def test_adapter_configs_that_would_serve_something_else_are_refused_by_name(c3, model, adapter, state):
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for change, words in CONFIG_CASES:
        path.write_text(_with(cfg, change))
        _inspect_refused(adapter, model, words)
    path.write_text(_with(cfg, CONFIG_CASES[0][0]))  # the case, through the CLI: exit 78, one line
    r = run("plan", "-c", str(c3), "-m", str(model), "--adapter", str(adapter))
    _refused(r, "not valid JSON")
    assert r.code == 78


def test_adapter_tensors_that_match_no_lora_layer_are_refused_by_name(model, adapter):
    import mlx.core as mx

    weights = adapter / "adapters.safetensors"
    good = dict(mx.load(str(weights)))
    a = "model.layers.7.self_attn.q_proj.lora_a"
    cases = [({**good, "model.layers.7.self_attn.nope.lora_a": good[a]}, "not a linear of the model"),
             ({**good, "model.layers.7.self_attn.q_proj.m": mx.zeros((64,))}, "not a weight of a lora layer"),
             ({k: v for k, v in good.items() if k != a}, "has no lora_a for model.layers.7.self_attn.q_proj")]
    for tensors, words in cases:
        mx.save_safetensors(str(weights), tensors)
        _inspect_refused(adapter, model, words)


def test_adapter_config_is_read_as_a_small_regular_file_of_the_folder(c3, model, adapter, state, tmp_path):
    """A link out of the folder (to /dev/zero: MemoryError on 5b99778), a link to itself, a FIFO (plan blocked
    forever there), a file past the bound: each refused in one line, at once."""
    import os
    import threading

    path = adapter / "adapter_config.json"
    (tmp_path / "elsewhere.json").write_text(path.read_text())

    def plan():
        return run("plan", "-c", str(c3), "-m", str(model), "--adapter", str(adapter))

    path.unlink()
    path.symlink_to("/dev/zero")
    _refused(plan(), "outside the adapter folder")
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    _refused(plan(), "outside the adapter folder")
    path.unlink()
    path.symlink_to(path.name)
    _refused(plan(), "is a link that loops")
    path.unlink()
    with open(path, "wb") as f:
        f.truncate((1 << 20) + 1)
    _refused(plan(), "is too large")
    path.unlink()
    os.mkfifo(adapter / "fifo")
    path.symlink_to("fifo")
    got = []
    t = threading.Thread(target=lambda: got.append(plan()), daemon=True)  # blocks forever when the FIFO is opened
    t.start()
    t.join(30)
    assert got, "plan blocked on a FIFO"
    _refused(got[0], "is not a regular file")
