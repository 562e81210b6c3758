import json
import struct

import pytest

from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.plan.model import inspect_model, work

from modelfiles import make_model


def test_facts_of_a_single_file_model(tmp_path):
    f = inspect_model(make_model(tmp_path / "m", layers=4, hidden=64, heads=4, kv_heads=2, inter=128, vocab=256))
    per_layer = 2 * (64 * 64 * 2 + 2 * 32 * 64 + 2 * 128 * 64 + 64 * 128 + 2 * 64)
    assert f.num_layers == 4 and f.layer_bytes == [per_layer] * 4
    assert f.shared_bytes == 2 * (256 * 64 * 2 + 64)
    assert f.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2
    assert f.pipeline_capable and not f.tie_word_embeddings


def test_sharded_equals_single(tmp_path):
    a = inspect_model(make_model(tmp_path / "a", layers=6))
    b = inspect_model(make_model(tmp_path / "b", layers=6, shards=3))
    assert a.layer_bytes == b.layer_bytes and a.shared_bytes == b.shared_bytes
    assert len(b.files) == 3


def test_quantized_weights_count_scales_and_biases(tmp_path):
    q = inspect_model(make_model(tmp_path / "q", layers=2, hidden=128, inter=256, quant_bits=4))
    full = inspect_model(make_model(tmp_path / "f", layers=2, hidden=128, inter=256))
    assert q.quantization == {"group_size": 64, "bits": 4}
    assert q.layer_bytes[0] < full.layer_bytes[0] / 2


def test_work_is_logical_parameters_whatever_the_bits(tmp_path):
    # SmolLM2-135M's layout at toy size: 4-bit layers, the tied embedding (the head) at 8 bits by mlx-lm's
    # per-module override. Stage time follows these counts, not bytes (docs/allocation.md).
    dims = dict(layers=3, hidden=128, heads=4, kv_heads=2, inter=256, vocab=512)
    folder = make_model(tmp_path / "q", tie=True, quant_bits=4, embed_bits=8, **dims)
    per_layer = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 256 + 2 * 128  # q, o; k, v; gate, up, down; two norms
    for classify in (True, False):  # what mlx-lm's loader keeps, and the names as the files hold them
        q = inspect_model(folder, classify=classify)
        assert q.layer_work == [per_layer] * 3 and q.head_work == 512 * 128
    plain = inspect_model(make_model(tmp_path / "f", **dims))  # 16-bit, an untied lm_head of the same shape
    assert (plain.layer_work, plain.head_work) == (q.layer_work, q.head_work)
    assert plain.layer_bytes[0] > 3 * q.layer_bytes[0]


def test_routed_experts_count_the_share_a_token_goes_through():
    common = {"model.layers.0.mlp.gate.weight": ("BF16", [4, 16]),  # the router and a shared expert: every token
              "model.layers.0.mlp.shared_experts.up_proj.weight": ("BF16", [8, 16]),
              "model.embed_tokens.weight": ("BF16", [100, 16]), "lm_head.weight": ("BF16", [100, 16])}
    projections = ("gate_proj", "up_proj", "down_proj")
    one_each = {f"model.layers.0.mlp.experts.{e}.{p}.weight": ("BF16", [8, 16]) for e in range(4) for p in projections}
    stacked = {f"model.layers.0.mlp.switch_mlp.{p}.weight": ("BF16", [4, 8, 16]) for p in projections}
    config = {"num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2}
    two_of_four = 4 * 16 + 8 * 16 + 2 * 3 * 8 * 16
    assert work({**common, **one_each}, config, 1) == work({**common, **stacked}, config, 1) == ([two_of_four], 1600)
    assert work({**common, **stacked}, {"num_hidden_layers": 1}, 1) == ([two_of_four + 2 * 3 * 8 * 16], 1600)


def test_tied_embeddings_have_no_head(tmp_path):
    t = inspect_model(make_model(tmp_path / "t", tie=True))
    u = inspect_model(make_model(tmp_path / "u", tie=False))
    assert t.tie_word_embeddings and t.shared_bytes < u.shared_bytes


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate-header":
        path.write_bytes(bytes(data[:20]))
    elif how == "truncate-data":
        path.write_bytes(bytes(data[:-10]))
    elif how == "garbage-length":
        path.write_bytes(struct.pack("<Q", 1 << 60) + bytes(data[8:]))
    elif how == "bad-json":
        n = struct.unpack("<Q", data[:8])[0]
        data[8 + n // 2] = ord("{")
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how,message", [
    ("truncate-header", "truncated safetensors file"),
    ("truncate-data", "ends past the end of the file"),
    ("garbage-length", "corrupt safetensors header"),
    ("bad-json", "not valid JSON"),
    ("empty", "truncated safetensors file"),
])
def test_corrupt_headers_are_clear_errors(tmp_path, how, message):
    m = make_model(tmp_path / "m", layers=2)
    _corrupt(m / "model.safetensors", how)
    with pytest.raises(IntegrityError) as e:
        inspect_model(m)
    assert message in e.value.message


def test_missing_pieces(tmp_path):
    with pytest.raises(MissingInput):
        inspect_model(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingInput, match="no config.json"):
        inspect_model(tmp_path / "empty")
    m = make_model(tmp_path / "m", layers=2)
    (m / "model.safetensors").unlink()
    with pytest.raises(MissingInput, match="no \\*.safetensors"):
        inspect_model(m)


def test_layer_beyond_config_is_refused(tmp_path):
    m = make_model(tmp_path / "m", layers=4)
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError, match="layer 2"):
        inspect_model(m)


def test_text_config_nesting_is_tolerated(tmp_path):
    m = make_model(tmp_path / "m", layers=3)
    cfg = json.loads((m / "config.json").read_text())
    text = {k: cfg.pop(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")}
    cfg["text_config"] = text
    cfg["unknown_future_key"] = {"x": 1}
    (m / "config.json").write_text(json.dumps(cfg))
    assert inspect_model(m).num_layers == 3


def test_facts_hash_changes_with_weights_layout(tmp_path):
    a = inspect_model(make_model(tmp_path / "a", layers=4))
    b = inspect_model(make_model(tmp_path / "b", layers=4))
    c = inspect_model(make_model(tmp_path / "c", layers=4, inter=256))
    assert a.facts_hash == b.facts_hash != c.facts_hash


@pytest.mark.parametrize("key,value", [("num_key_value_heads", "abc"), ("head_dim", [1]), ("num_hidden_layers", True),
                                       ("hidden_size", 0)])
def test_bad_config_values_are_clear_errors(tmp_path, key, value):
    from clusterctl.errors import ConfigError

    m = make_model(tmp_path / "m", layers=2)
    cfg = json.loads((m / "config.json").read_text())
    cfg[key] = value
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=key):
        inspect_model(m)


def test_index_that_is_a_folder(tmp_path):
    m = make_model(tmp_path / "m", layers=2)
    (m / "model.safetensors.index.json").mkdir()
    with pytest.raises(IntegrityError, match="not a regular file"):
        inspect_model(m)


@pytest.mark.parametrize("name,note", [("glm4_moe", "layer(s) 4 beyond num_hidden_layers"),
                                       ("ministral3", "60 tensors of other modalities")])
def test_a_released_layout_plans_and_passes_the_launch_recheck(name, note, tmp_path):
    """GLM-4.5's multi-token-prediction layer (``model.layers.<num_hidden_layers>.eh_proj`` ...) and Ministral-3's
    vision tower (more layers than the text model): mlx-lm's loader drops both. The plan says so and counts what
    it keeps; the launch's re-check of the deployment (no class built) applies the same rules: no exit 65."""
    from archmodels import build_released

    from clusterctl.launch.preflight import check_inputs_unchanged
    from clusterctl.protocol.deployment import PlanOptions
    from clusterctl.plan.inventory import parse_cluster
    from clusterctl.plan.planner import make_deployment

    path = build_released(name, tmp_path / name, None)
    facts = inspect_model(path)
    assert any(note in n for n in facts.notes), facts.notes
    recheck = inspect_model(path, classify=False)
    assert (recheck.layer_bytes, recheck.shared_bytes, recheck.layer_work, recheck.kv_layers, recheck.notes) == \
        (facts.layer_bytes, facts.shared_bytes, facts.layer_work, facts.kv_layers, facts.notes)
    nodes = [{"name": n, "memory_gb": 8, "host": f"10.0.0.{i}", "ips": [f"10.0.0.{i}"], "model_path": str(path)}
             for i, n in enumerate("ab", 1)]
    dep = make_deployment(parse_cluster({"cluster": {"name": "lab"}, "node": nodes}), facts, str(path),
                          PlanOptions(parallel="pipeline"))
    assert any(note in w for w in dep.warnings)
    check_inputs_unchanged(dep)  # raised IntegrityError "... is for layer 4, but config.json says 4 layers"


def test_an_fp8_checkpoint_plans_as_mlx_lm_loads_it(tmp_path):
    """DeepSeek-V3 as released: FP8 weights (``F8_E4M3`` with block scales), per-expert tensors, ``kv_b_proj`` and
    the MTP layer 61. mlx-lm's sanitize dequantizes, stacks, absorbs and drops; plan ran it only on dtypes it knew,
    so it took the raw names and refused the MTP layer (65). What it keeps is exactly the class's parameters."""
    from archmodels import DEEPSEEK_V3_FP8, write_deepseek_v3_fp8_headers
    from mlx.utils import tree_flatten

    from clusterctl.modelfiles.archs import build_lazy, kept_tensors
    from clusterctl.plan.model import read_safetensors_header

    path = write_deepseek_v3_fp8_headers(tmp_path / "v3")
    facts = inspect_model(path)
    assert facts.num_layers == 61 and facts.pipeline == "stages"
    assert any("layer(s) 61 beyond" in n for n in facts.notes)
    assert inspect_model(path, classify=False).layer_bytes == facts.layer_bytes
    raw = {n: (t["dtype"], t["shape"]) for n, t in read_safetensors_header(path / "model.safetensors")[0].items()}
    kept = kept_tensors(DEEPSEEK_V3_FP8, raw)
    params = dict(tree_flatten(build_lazy(json.loads(json.dumps(DEEPSEEK_V3_FP8))).parameters()))
    assert {n: s for n, (_, s) in kept.items()} == {n: list(p.shape) for n, p in params.items()}
    assert {d for d, _ in kept.values()} <= {"BF16", "F32"}  # dequantized: what a rank holds, 2 bytes a weight


def test_the_batching_probe_is_tried_once_per_class_and_args(tmp_path, monkeypatch):
    """plan's batching probe (modelfiles/archs.py) keeps its answer per (class, args): a config that differs only
    in a key the class never reads is not tried again; one that differs in a key it reads, or of another class, is
    tried, and gets its own answer (a gemma2 that cannot batch after a qwen2 that can)."""
    from clusterctl.modelfiles import archs

    tries = []
    real = archs._try_batching
    monkeypatch.setattr(archs, "_try_batching", lambda model: tries.append(type(model).__module__) or real(model))
    monkeypatch.setattr(archs, "_BATCHING_TRIED", {})
    qwen = json.loads((make_model(tmp_path / "q", layers=2) / "config.json").read_text())
    assert archs.batching(qwen) == (True, None)
    assert archs.batching({**qwen, "sliding_window_pattern": 10**12}) == (True, None) and len(tries) == 1
    assert archs.batching({**qwen, "rope_theta": 500.0}) == (True, None) and len(tries) == 2
    gemma = json.loads((make_model(tmp_path / "g", layers=2, model_type="gemma2") / "config.json").read_text())
    ok, why = archs.batching({**gemma, "head_dim": 16, "query_pre_attn_scalar": 16})
    assert ok is False and "cannot be broadcast" in why
    assert tries == ["mlx_lm.models.qwen2"] * 2 + ["mlx_lm.models.gemma2"]
