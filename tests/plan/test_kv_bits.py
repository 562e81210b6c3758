"""plan --kv-bits: the quantized KV cache's size against mlx-lm's own ``QuantizedKVCache`` (measured like
test_kv.py's estimates: nbytes after a prompt of N - 2 tokens and 2 decoded ones, N a multiple of the 256-token
allocation step), the context it lets fit, the families whose caches mlx-lm cannot quantize refused by name, the
flags checked, and files from before it still verifying with the same identity."""

from __future__ import annotations

import json

import pytest

from archmodels import FAMILIES, build, config_of
from cliutil import run
from clusters import write_cluster
from clusterctl.errors import ConfigError
from clusterctl.plan.fit import kv_bytes
from clusterctl.plan.kvcache import kv_layers
from clusterctl.plan.kvquant import quantized_layer
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment, replan_same_inputs
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.replan import derive
from clusterctl.protocol.deployment import PlanOptions, decode, deployment_hash, encode
from clusterctl.protocol.signing import Keyring
from modelfiles import make_model

N = 512
WIDE = {"hidden_size": 256, "head_dim": 64}  # heads of 64 numbers: every group size divides them
QUANTIZABLE = ["llama", "qwen2", "qwen3", "phi3", "starcoder2", "qwen3_moe"]


def measured_quantized(config: dict, bits: int, group: int, start: int = 0) -> int:
    """nbytes of mlx-lm's caches after N tokens, quantized as ``mlx_lm.generate`` does (maybe_quantize_kv_cache
    after every forward pass)."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from clusterctl.modelfiles.archs import build_lazy

    mx.random.seed(0)
    model = build_lazy(config)
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, 2048, (1, N))
    for s, e in ((0, N - 2), (N - 2, N - 1), (N - 1, N)):
        mx.eval(model(tokens[:, s:e], cache=cache))
        maybe_quantize_kv_cache(cache, start, group, bits)
        mx.eval([c.state[:2] for c in cache])
    assert all(type(c).__name__ == "QuantizedKVCache" for c in cache)
    return sum(c.nbytes for c in cache)


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("family", QUANTIZABLE)
def test_quantized_estimate_matches_mlx_lm_quantized_caches(family, bits, group):
    config = {**config_of(family), **WIDE}
    opts = PlanOptions(kv_bits=bits, kv_group_size=group, quantized_kv_start=0)
    layers = kv_layers(config, 4)  # the weights are float32: so are the keys, scales and biases
    estimate = kv_bytes([quantized_layer(k, opts, 4) for k in layers], N, 1)
    measured = measured_quantized(config, bits, group)
    assert 0.9 <= estimate / measured <= 1.1, (family, estimate, measured)
    assert estimate < kv_bytes(layers, N, 1) / 3  # and far below full precision


def _cluster(memory_gb: float, n: int = 2):
    return parse_cluster({"cluster": {"name": "lab"}, "node": [
        {"name": f"n{i}", "memory_gb": memory_gb, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"],
         "model_path": "/models/m"} for i in range(n)]})


@pytest.fixture
def facts(tmp_path):
    """8 float16 layers of 8 KV heads of 64: 2 KiB of keys and values per token and layer in full precision."""
    return inspect_model(make_model(tmp_path / "m", layers=8, hidden=512, heads=8, kv_heads=8), classify=False)


def test_a_4_bit_cache_fits_a_longer_context_on_the_same_nodes(facts):
    full = PlanOptions(context=60000, batch=1, parallel="pipeline", prompt_cache_gb=0)
    with pytest.raises(ConfigError, match="does not fit"):
        make_deployment(_cluster(1), facts, "/models/m", full)
    q4 = full.model_copy(update={"kv_bits": 4, "quantized_kv_start": 0})
    dep = make_deployment(_cluster(1), facts, "/models/m", q4)
    per_token = 8 * 64 * 2 * 4 // 8 + 2 * (8 * 64 * 2 // 64) * 2  # packed numbers + a scale and a bias per group
    assert [r.planned.kv for r in dep.ranks] == [per_token * 60000 * r.layers for r in dep.ranks]
    fit = dep.kv_fit
    assert fit.max_context >= 60000 > fit.max_context_full
    assert 3.4 < fit.max_context / fit.max_context_full < 3.6  # 2 bytes vs 0.5 + 4/64 per number
    assert make_deployment(_cluster(1), facts, "/models/m", full.model_copy(update={"context": 1000})).kv_fit is None


def test_a_sequence_is_full_precision_until_quantized_kv_start(facts):
    """Below the start nothing is quantized; above it the larger of the full cache at the start and the
    quantized one at the context."""
    base = PlanOptions(context=3000, batch=1, parallel="pipeline", prompt_cache_gb=0)
    plain = make_deployment(_cluster(4), facts, "/models/m", base)
    late = make_deployment(_cluster(4), facts, "/models/m", base.model_copy(update={"kv_bits": 4}))
    assert [r.planned.kv for r in late.ranks] == [r.planned.kv for r in plain.ranks]  # 3000 < 5000
    held = make_deployment(_cluster(4), facts, "/models/m",
                           base.model_copy(update={"kv_bits": 8, "quantized_kv_start": 2000}))
    full_at_start = 2000 * 2 * 8 * 64 * 2
    assert [r.planned.kv for r in held.ranks] == [full_at_start * r.layers for r in held.ranks]


def test_the_prompt_cache_holds_more_tokens_when_every_entry_is_quantized(facts):
    base = PlanOptions(context=1000, batch=1, parallel="pipeline", prompt_cache_gb=0.25)
    plain = make_deployment(_cluster(4), facts, "/models/m", base).prompt_cache_tokens
    q = make_deployment(_cluster(4), facts, "/models/m",
                        base.model_copy(update={"kv_bits": 4, "quantized_kv_start": 0})).prompt_cache_tokens
    assert 3.4 < q / plain < 3.6


@pytest.mark.parametrize("family,why", [("gemma3_text", "sliding-window"), ("gpt_oss", "sliding-window"),
                                        ("deepseek_v3", "MLA latent"), ("deepseek_v2", "MLA keys"),
                                        ("bailing_hybrid", "linear-attention")])
def test_families_mlx_lm_cannot_quantize_are_refused_by_name(family, why, tmp_path):
    model = build(family, tmp_path / family, None)
    cluster = write_cluster(tmp_path / "c.toml", '[cluster]\nname = "lab"\n[[node]]\nname = "a"\nmemory_gb = 64\n')
    state = tmp_path / "state"
    r = run("plan", "-c", str(cluster), "-m", str(model), "--kv-bits", "4", "--state-dir", str(state))
    assert r.code != 0 and why in r.stderr and f"model type {family!r}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # the line and its hint
    assert not (state / "deployments").exists() or not any((state / "deployments").iterdir())
    assert run("plan", "-c", str(cluster), "-m", str(model), "--state-dir", str(state)).code == 0


def test_a_group_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    facts = inspect_model(make_model(tmp_path / "m", hidden=64, heads=4, kv_heads=2), classify=False)  # 16 wide
    with pytest.raises(ConfigError, match="heads of 16 numbers, which --kv-group-size 32 does not divide"):
        make_deployment(_cluster(4), facts, "/models/m", PlanOptions(kv_bits=4, kv_group_size=32))


@pytest.mark.parametrize("flags,said", [(["--kv-bits", "3"], "--kv-bits: 3 is not valid (choose from 4, 8)"),
                                        (["--kv-bits", "8", "--kv-group-size", "48"],
                                         "--kv-group-size: 48 is not valid (choose from 32, 64, 128)"),
                                        (["--kv-group-size", "32"], "need --kv-bits 4 or 8"),
                                        (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start")])
def test_flags_are_checked_in_one_line(flags, said, tmp_path):
    model = make_model(tmp_path / "m", hidden=256, heads=4, kv_heads=2)
    cluster = write_cluster(tmp_path / "c.toml", '[cluster]\nname = "lab"\n[[node]]\nname = "a"\nmemory_gb = 64\n')
    r = run("plan", "-c", str(cluster), "-m", str(model), "--state-dir", str(tmp_path / "s"), *flags)
    assert r.code == 2 and said in r.stderr, r.stderr
    assert not (tmp_path / "s" / "deployments").exists() or not any((tmp_path / "s" / "deployments").iterdir())


def test_the_setting_is_signed_shown_and_old_files_keep_their_identity(facts, tmp_path):
    from clusterctl.atomic import dumps
    from clusterctl.render import kv_bits_note
    from clusterctl.protocol.signing import sign_payload

    sk = Keyring(tmp_path / "keys").signing_key()
    trusted = Keyring(tmp_path / "keys").public_keys()
    base = PlanOptions(context=8192, batch=1, parallel="pipeline")
    plain = make_deployment(_cluster(4), facts, "/models/m", base)
    q = make_deployment(_cluster(4), facts, "/models/m", base.model_copy(update={"kv_bits": 4}))
    assert q.deployment_id != plain.deployment_id and q.plan_hash == plain.plan_hash
    assert decode(encode(q, sk), trusted).deployment == q
    assert "KV cache 4-bit (groups of 64, from token 5000): up to" in kv_bits_note(q) and kv_bits_note(plain) == ""
    # a file written before --kv-bits: none of its fields; it loads, verifies and keeps its id
    doc = plain.model_dump(mode="json")
    for k in ("kv_bits", "kv_group_size", "quantized_kv_start"):
        del doc["options"][k]
    del doc["kv_fit"]
    old = decode(sign_payload(dumps(doc), "deployment", sk), trusted).deployment
    assert old == plain and deployment_hash(old) == plain.deployment_hash
    again = replan_same_inputs(q, facts)  # launch's re-check: the same placement, the quantized KV recounted
    assert again.placement == q.placement and again.placement != plain.placement


def test_replan_keeps_or_changes_the_setting(facts):
    q = make_deployment(_cluster(4), facts, "/models/m", PlanOptions(context=8192, kv_bits=8, kv_group_size=32))
    kept = derive(q, options={})
    assert (kept.options.kv_bits, kept.options.kv_group_size) == (8, 32) and kept.derived["kv_bits"] == "8"
    off = derive(q, options={"kv_bits": None})
    assert off.options.kv_bits is None and off.given["kv_bits"] == "off"
    assert derive(q, options={"kv_bits": 4}).options.kv_bits == 4
    json.dumps(off.to_json())


def test_replan_flags_give_only_what_was_given_and_0_turns_it_off():
    from clusterctl.cli.options import kv_options
    from clusterctl.errors import UsageError

    assert kv_options(None, None, None, replan=True) == {}
    assert kv_options(0, None, None, replan=True) == {"kv_bits": None}
    assert kv_options(None, 32, 100, replan=True) == {"kv_group_size": 32, "quantized_kv_start": 100}
    assert kv_options(4, None, None) == {"kv_bits": 4}
    with pytest.raises(UsageError):
        kv_options(None, 32, None)  # plan: a group size without --kv-bits
