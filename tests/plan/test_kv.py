"""The KV-cache estimate per layer (plan/kvcache.py kv_layers) against mlx-lm's own caches, and what it changes in a
plan (plan/fit.py).

Measured: the ``nbytes`` of the caches ``mlx_lm.models.cache.make_prompt_cache(model)`` makes, after a prompt of
N - 2 tokens and 2 decoded tokens (N = 512), for tiny random-weight models of every architecture in the test
matrix (tests/archmodels.py) and of the other classes the estimate names. N is a multiple of KVCache's 256-token
allocation step, so a full-attention cache holds exactly N tokens (any other N would show up to 255 tokens of
step slack, not an estimate error), and far above the sliding windows (6). The decoded tokens matter: a
RotatingKVCache keeps a whole prompt chunk (window + chunk - 1 tokens) until the next step trims it to its window;
what a serving slot holds is the trimmed size.
"""

from __future__ import annotations

import json

import pytest

from archmodels import BASE, FAMILIES, MLX_PIPELINED, UNBATCHABLE, WRAPPERS, config_of
from clusterctl.errors import DoesNotFit
from clusterctl.protocol.deployment import PlanOptions, decode, encode
from clusterctl.plan.fit import kv_bytes
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.kvcache import KV_ARCH_REMAP, KV_REMAP, kv_layers
from clusterctl.plan.model import KvLayer, inspect_model
from clusterctl.plan.planner import make_deployment, replan_same_inputs
from clusterctl.protocol.signing import Keyring
from modelfiles import make_model

N = 512

_MLA = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16}
_MOE = {"moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0}
_ROPE4 = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                              "original_max_position_embeddings": 4096}}
_LINEAR = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}
_SWA = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2}

# classes the estimate names beyond the test matrix (tiny configs of the same sizes)
EXTRA: dict[str, dict] = {
    "llama+layer_types": {"model_type": "llama", **BASE, **_SWA},
    "mistral+layer_types": {"model_type": "mistral", **BASE, **_SWA},
    "ministral3": {"model_type": "ministral3", **BASE, **_SWA, **_ROPE4},
    "cohere2": {"model_type": "cohere2", **BASE, "sliding_window": 6, "sliding_window_pattern": 2,
                "layer_norm_eps": 1e-5, "logit_scale": 1.0},
    "olmo3": {"model_type": "olmo3", **BASE, "sliding_window": 6},  # its default layer types: 3 sliding, 1 full
    "gemma3 (text_config)": {"model_type": "gemma3", "vocab_size": 2048, "text_config": config_of("gemma3_text")},
    "kimi_k2 (deepseek_v3)": {**config_of("deepseek_v3"), "model_type": "kimi_k2"},
    "glm4_moe_lite": {"model_type": "glm4_moe_lite", **BASE, **_MLA, **_MOE},
    "mistral4": {"model_type": "mistral4", **BASE, **_MLA, **_MOE, **_ROPE4},
    "deepseek_v32": {"model_type": "deepseek_v32", **BASE, **_MLA, **_MOE, "index_head_dim": 16, "index_n_heads": 2,
                     "index_topk": 8},
    "glm_moe_dsa": {"model_type": "glm_moe_dsa", **BASE, **_MLA, **_MOE, "index_head_dim": 16, "index_n_heads": 2,
                    "index_topk": 8, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                    "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "youtu_llm": {"model_type": "youtu_llm", **BASE, **_MLA},
    # minicpm3's values are hidden/heads wide whatever v_head_dim says
    "minicpm3": {"model_type": "minicpm3", **BASE, **_MLA, "v_head_dim": 8, "scale_emb": 1.0, "scale_depth": 1.0,
                 "dim_model_base": 64, "rope_scaling": {"original_max_position_embeddings": 4096}},
    "qwen3_5 (text_config)": {"model_type": "qwen3_5",
                              "text_config": {"model_type": "qwen3_5_text", **BASE, **_LINEAR}},
    "qwen3_5_moe (text_config)": {"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", **BASE, **_LINEAR, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}},
}
MATRIX = {f: config_of(f) for f in [*FAMILIES, *UNBATCHABLE, *WRAPPERS, *MLX_PIPELINED]}


def measured_bytes(config: dict, n: int = N, decoded: int = 2) -> int:
    """Bytes of mlx-lm's own caches for this model after n tokens (float32 random weights)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from clusterctl.modelfiles.archs import build_lazy

    mx.random.seed(0)
    model = build_lazy(config)
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, 2048, (1, n))
    mx.eval(model(tokens[:, : n - decoded], cache=cache), [c.state for c in cache])
    for i in range(n - decoded, n):
        mx.eval(model(tokens[:, i: i + 1], cache=cache), [c.state for c in cache])
    return sum(c.nbytes for c in cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*MATRIX, *EXTRA])
def test_estimate_matches_mlx_lm_caches(name):
    config = MATRIX.get(name) or EXTRA[name]
    estimate = sum(layer.bytes_at(N) for layer in kv_layers(config, 4))  # the weights are float32
    measured = measured_bytes(config)
    assert 0.9 <= estimate / measured <= 1.1, (name, estimate, measured)


def test_estimate_per_attention_type():
    by_kind = {name: {k.kind for k in kv_layers(c, 2)} for name, c in {**MATRIX, **EXTRA}.items()}
    assert by_kind["llama"] == {"full"} and by_kind["mistral+layer_types"] == {"full", "sliding"}
    assert by_kind["gemma3_text"] == by_kind["gpt_oss"] == by_kind["gemma3 (text_config)"] == {"full", "sliding"}
    assert by_kind["deepseek_v3"] == by_kind["kimi_k2 (deepseek_v3)"] == by_kind["mistral4"] == {"mla"}
    assert by_kind["deepseek_v2"] == {"mla-heads"}
    assert by_kind["qwen3_next"] == by_kind["qwen3_5 (text_config)"] == {"full", "linear"}
    assert by_kind["bailing_hybrid"] == by_kind["bailing_hybrid_gla"] == {"mla", "linear"}
    # a sliding_window mlx-lm's class does not use (qwen2, phi3, mistral without layer_types) counts in full
    for model_type in ("qwen2", "phi3", "mistral", "starcoder2"):
        assert {k.window for k in kv_layers({"model_type": model_type, **BASE, "sliding_window": 6}, 2)} == {None}


def test_real_configs():
    """The per-token figures of published configs (their attention fields), old estimate against new."""
    v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
          "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128}
    [layer] = set(kv_layers(v3, 2))
    assert layer == KvLayer(kind="mla", bytes_per_token=(512 + 64) * 2, sharded=False)  # was 2 x 128 x 56 x 2
    v2_lite = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
               "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128}
    [layer] = set(kv_layers(v2_lite, 2))
    assert layer.bytes_per_token == 16 * (128 + 64 + 128) * 2 > 2 * 16 * 128 * 2  # mlx-lm caches every head
    gemma3_27b = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6}}
    layers = kv_layers(gemma3_27b, 2)
    assert sum(k.window is None for k in layers) == 10 and {k.window for k in layers} == {None, 1024}
    gpt_oss = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12}
    at_8k = sum(k.bytes_at(8192) for k in kv_layers(gpt_oss, 2))
    assert at_8k == 12 * 2 * 8 * 64 * 2 * (8192 + 128)


def test_tensor_parallel_divides_per_head_caches_but_not_an_mla_latent():
    heads = [KvLayer(kind="full", bytes_per_token=100)] * 4
    latent = [KvLayer(kind="mla", bytes_per_token=30, sharded=False)] * 4
    window = [KvLayer(kind="sliding", bytes_per_token=100, window=10)]
    assert kv_bytes(heads, 1000, 2, world=2) == 4 * 100 * 1000 * 2 // 2
    assert kv_bytes(latent, 1000, 2, world=2) == 4 * 30 * 1000 * 2
    assert kv_bytes(window, 1000, 3) == 100 * 10 * 3
    assert kv_bytes([KvLayer(kind="linear", state_bytes=7)], 10**6, 2) == 14


def test_remapped_model_types_agree_with_mlx_lm():
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    assert all(MODEL_REMAPPING.get(k) == v for k, v in KV_REMAP.items())
    assert KV_ARCH_REMAP == MODEL_ARCHITECTURE_REMAPPING


# ---- the dtype of what is cached --------------------------------------------------------------------------------

def _saved(folder, config: dict, dtype: str, norm_dtype: str | None = None):
    """A real model folder mlx-lm loads: the class's random weights cast to ``dtype`` (norms to ``norm_dtype``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import save_model

    from clusterctl.modelfiles.archs import build_lazy

    mx.random.seed(0)
    model = build_lazy(config)
    model.update(tree_map_with_path(
        lambda path, p: p.astype(getattr(mx, norm_dtype if norm_dtype and "norm" in path else dtype)),
        model.parameters()))
    mx.eval(model.parameters())
    assert tree_flatten(model.parameters())
    save_model(folder, model, donate_model=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("dtype,norm_dtype,torch_dtype,want", [
    ("float16", None, "float32", 2),  # mlx-lm loads the weights as stored: torch_dtype does not decide
    ("float16", "float32", "float16", 4),  # a float32 norm promotes the hidden state, and so the keys
    ("float32", None, "bfloat16", 4),
])
def test_kv_dtype_is_what_mlx_lm_caches(tmp_path, dtype, norm_dtype, torch_dtype, want):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    config = {**config_of("llama"), "torch_dtype": torch_dtype}
    folder = _saved(tmp_path / "m", config, dtype, norm_dtype)
    facts = inspect_model(folder, classify=False)
    assert facts.kv_dtype_bytes == want
    model, _ = load_model(folder)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(256)[None], cache=cache), [c.state for c in cache])
    assert cache[0].keys.dtype.size == want
    assert sum(c.nbytes for c in cache) == sum(k.bytes_at(256) for k in facts.kv_layers)


# ---- what it changes in a plan ------------------------------------------------------------------------------------

V3_ATTENTION = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
                "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16"}


@pytest.fixture
def mla_facts(tmp_path):
    """61 small BF16 layers under DeepSeek-V3's attention config (planning reads only config.json and headers)."""
    folder = make_model(tmp_path / "v3", layers=61, hidden=64, dtype="F16")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **V3_ATTENTION}))
    return inspect_model(folder, classify=False)


def _cluster(memory_gb: float, n: int = 2):
    return parse_cluster({"cluster": {"name": "lab"}, "node": [
        {"name": f"n{i}", "memory_gb": memory_gb, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"],
         "model_path": "/models/v3"} for i in range(n)]})


def test_an_mla_model_fits_where_the_old_estimate_did_not(mla_facts):
    old = mla_facts.model_copy(update={"kv_layers": []})  # the uniform estimate: 2 x KV heads x head size
    assert (old.kv_bytes_per_token_per_layer, mla_facts.kv_bytes_per_token_per_layer) == (2 * 128 * 56 * 2, 576 * 2)
    options = PlanOptions(context=4096, parallel="pipeline")
    with pytest.raises(DoesNotFit, match="does not fit"):
        make_deployment(_cluster(3), old, "/models/v3", options)  # 6.7 GiB of KV per slot over 2 ranks of 3 GB
    dep = make_deployment(_cluster(3), mla_facts, "/models/v3", options)
    assert dep.batch == 8 and dep.slots >= 8
    per_slot = (512 + 64) * 2 * 4096
    assert [r.planned.kv for r in dep.ranks] == [8 * per_slot * r.layers for r in dep.ranks]
    # with room for the old estimate's one slot, the new one admits 25 times as many (up to the default 8)
    roomy = _cluster(8)
    assert make_deployment(roomy, old, "/models/v3", options).slots == 1
    assert make_deployment(roomy, mla_facts, "/models/v3", options).slots >= 25


def test_tensor_plan_keeps_the_whole_latent_on_every_rank(mla_facts):
    dep = make_deployment(_cluster(8), mla_facts, "/models/v3", PlanOptions(context=4096, parallel="tensor",
                                                                             batch=1))
    assert [r.planned.kv for r in dep.ranks] == [(512 + 64) * 2 * 4096 * 61] * 2


def test_deployment_records_kv_layers_and_old_files_still_load_and_launch(mla_facts, tmp_path):
    sk = Keyring(tmp_path / "keys").signing_key()
    trusted = Keyring(tmp_path / "keys").public_keys()
    options = PlanOptions(context=4096, parallel="pipeline", batch=1)
    new = make_deployment(_cluster(16), mla_facts, "/models/v3", options)
    assert new.model.kv_layers == mla_facts.kv_layers and new.model.kv_bytes_per_token_per_layer == 1152
    assert decode(encode(new, sk), trusted).deployment == new
    assert replan_same_inputs(new, mla_facts).placement == new.placement
    # a file planned before per-layer estimates: no model.kv_layers, one (larger) size for every layer
    legacy = make_deployment(_cluster(16), mla_facts.model_copy(update={"kv_layers": []}), "/models/v3", options)
    doc = legacy.model_dump(mode="json")
    del doc["model"]["kv_layers"]
    del doc["deployment_hash"]  # as old as that: no identity hash either
    from clusterctl.atomic import dumps
    from clusterctl.protocol.signing import sign_payload

    loaded = decode(sign_payload(dumps(doc), "deployment", sk), trusted).deployment
    assert loaded.model.kv_layers is None and loaded.plan_hash == new.plan_hash
    assert loaded.placement != new.placement  # it planned more KV
    again = replan_same_inputs(loaded, mla_facts)  # what `launch` checks: still the placement it was approved with
    assert again.placement == loaded.placement and again.plan_hash == loaded.plan_hash
    assert again.model.kv_layers is None
