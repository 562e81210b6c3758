"""A LoRA adapter served by 2 real pipeline ranks: greedy tokens identical to one
``mlx_lm.load(model, adapter_path=...)`` process, and different from the base model's; offline, the rank's
``apply_adapter`` gives mlx-lm's logits (an adapter trained with dropout too) and refuses, by name, a config that
would serve something other than what it says."""

from __future__ import annotations

import pytest

import json

from adaptermodels import adapted_logits, adapted_tokens, build_adapter
from rankharness import RankCluster, complete, reference_tokens, tiny_model_path

PROMPTS = ["def main(argv):", "x = ["]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    model = tiny_model_path()
    adapter = build_adapter(model, tmp_path_factory.mktemp("adapter") / "lora", num_layers=6, dropout=0.1)
    return model, adapter  # trained with dropout, as mlx_lm.lora's configs are: served, nothing drops


def test_the_rank_applies_an_adapter_trained_with_dropout_as_mlx_lm_does(adapted):
    """A LoRA layer left in training mode drops a random 10% of its input on every call: the logits would
    differ from mlx-lm's (by several units) and from one call to the next."""
    import mlx.core as mx

    model, adapter = adapted
    tokens = [5, 17, 3, 99, 42, 7, 1, 64]
    want = adapted_logits(model, adapter, tokens, rank_side=False)
    got = [adapted_logits(model, adapter, tokens, rank_side=True) for _ in range(2)]
    for g in got:
        assert mx.abs(g - want).max().item() < 1e-4, mx.abs(g - want).max().item()


@pytest.mark.parametrize("field, value, words", [
    ("scale", float("inf"), "not valid JSON"),
    ("keys", ["self_attn.nope"], "matches no LoRA layer"),
    ("rank", 0, "lora_parameters.rank 0"),
])
def test_the_rank_refuses_a_config_that_would_serve_something_else_by_name(adapted, tmp_path, field, value, words):
    """What plan refuses, the rank refuses too when it loads (a folder planned without the check)."""
    import shutil

    from mlx_lm.utils import load_model

    from clusterctl.errors import ConfigError
    from clusterctl.rank.engine.adapter import apply_adapter

    model, adapter = adapted
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["lora_parameters"][field] = value
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    m, _ = load_model(model)
    with pytest.raises(ConfigError, match=words) as e:
        apply_adapter(m, len(m.layers), str(bad))
    assert "\n" not in e.value.message


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["overlap", "lockstep"])
def test_two_pipeline_ranks_serve_an_adapter_like_one_mlx_lm_process(adapted, schedule, tmp_path):
    """The adapter covers the last 6 of the model's 8 blocks: rank 0 holds blocks 4-7, rank 1 blocks 0-3, so each
    rank maps "the last num_layers" onto its own slice (rank 1 adapts blocks 2 and 3 only)."""
    from clusterctl.modelfiles.manifest import build_manifest

    model, adapter = adapted
    want = {p: adapted_tokens(model, adapter, p, 12) for p in PROMPTS}
    assert any(want[p] != reference_tokens(model, p, 12) for p in PROMPTS)  # the adapter changes the tokens
    over = {"adapter_path": str(adapter), "adapter_hash": build_manifest(adapter).manifest_hash,
            "schedule": schedule}
    with RankCluster(tmp_path, model, [4, 4], tag=f"lora{schedule[:2]}", overrides=over).up() as c:
        for p in PROMPTS:
            assert complete(c, p, 12)["token_ids"] == want[p]


@pytest.fixture(scope="module")
def adapted_quantized(tmp_path_factory):
    """The tiny model quantized to 4 bits (mlx-lm's convert: a few seconds), with an adapter on its
    QuantizedLinear layers."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("q4")
    convert(str(tiny_model_path()), mlx_path=str(root / "model"), quantize=True, q_bits=4, q_group_size=64)
    return root / "model", build_adapter(root / "model", root / "lora", num_layers=6)


@pytest.mark.slow
def test_an_adapter_on_a_quantized_model_serves_like_one_mlx_lm_process(adapted_quantized, tmp_path):
    from clusterctl.modelfiles.manifest import build_manifest

    model, adapter = adapted_quantized
    want = adapted_tokens(model, adapter, PROMPTS[0], 12)
    assert want != reference_tokens(model, PROMPTS[0], 12)
    over = {"adapter_path": str(adapter), "adapter_hash": build_manifest(adapter).manifest_hash}
    with RankCluster(tmp_path, model, [4, 4], tag="loraq4", overrides=over).up() as c:
        assert complete(c, PROMPTS[0], 12)["token_ids"] == want


@pytest.mark.slow
def test_a_rank_refuses_an_adapter_changed_after_plan_in_one_line(adapted, tmp_path):
    from clusterctl.modelfiles.manifest import build_manifest

    model, adapter = adapted
    planned = build_manifest(adapter).manifest_hash
    bad = build_adapter(model, tmp_path / "tampered", num_layers=6, seed=9)
    with RankCluster(tmp_path / "c", model, [4, 4], tag="loratamp",
                     overrides={"adapter_path": str(bad), "adapter_hash": planned}) as c:
        c.start()
        assert c.wait_exit(0, 90) not in (0, None)
        m = c.marker(0)
        assert m.state == "failed" and "is not the one planned" in m.error, m.error
        assert "Traceback" not in c.logs(0)
