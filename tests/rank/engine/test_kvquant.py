"""rank/engine/kvquant.py in one process: mlx-lm's BatchGenerator on the quantizing batch caches gives each request the
tokens of one mlx-lm process generating alone with the same kv settings, a request joining a batch that is
already quantized included (the joining group is quantized as it joins, as its own cache would be after its
prompt)."""

from __future__ import annotations

import pytest

from rankharness import reference_tokens, tiny_model_path


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_a_late_joiner_and_the_running_rows_keep_their_own_tokens(bits, group):
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from clusterctl.rank.engine.kvquant import quantize_kv

    path = tiny_model_path()
    kv = {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": 0}
    prompts = ["def main(argv):", "x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14", "import os\n"]
    want = [reference_tokens(path, p, 16, **kv) for p in prompts]
    if bits == 4:  # 4 bits changes these tokens (8 bits leaves them as full precision has them)
        assert any(w != reference_tokens(path, p, 16) for w, p in zip(want, prompts))
    model, tok = load(str(path))
    quantize_kv(model, bits, group, 0)
    gen = BatchGenerator(model, stop_tokens=[[e] for e in tok.eos_token_ids], completion_batch_size=4,
                         prefill_batch_size=4)
    uids = list(gen.insert([tok.encode(p) for p in prompts[:2]], max_tokens=[16, 16]))
    got: dict[int, list[int]] = {u: [] for u in uids}
    steps = 0
    while out := gen.next_generated():
        steps += 1
        if steps == 4:  # the first two are decoding from a quantized cache by now
            (late,) = gen.insert([tok.encode(prompts[2])], max_tokens=[16])
            uids.append(late)
            got[late] = []
        for r in out:
            if r.token not in tok.eos_token_ids:
                got[r.uid].append(r.token)
    assert [got[u] for u in uids] == want


QUANTIZABLE = ["llama", "qwen2", "qwen3", "phi3", "olmo2", "starcoder2", "granite", "qwen3_moe", "glm4_moe"]


@pytest.mark.slow
@pytest.mark.parametrize("family", QUANTIZABLE)
def test_every_family_the_plan_admits_decodes_in_a_batch_like_mlx_lm_alone(family):
    """The families of the test matrix whose caches mlx-lm quantizes (random weights, heads of 64): two prompts
    of different lengths decoded together, each with the tokens ``generate_step`` gives it alone."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.generate import BatchGenerator, generate_step

    from archmodels import config_of
    from clusterctl.rank.engine.kvquant import quantize_kv
    from clusterctl.modelfiles.archs import build_lazy

    mx.random.seed(0)
    model = build_lazy({**config_of(family), "hidden_size": 256, "head_dim": 64})
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))  # tokens that vary
    mx.eval(model.parameters())
    prompts = [[5, 17, 99, 3, 250, 1000, 42], [7, 8, 9]]
    want = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=10, kv_bits=4, kv_group_size=64,
                                         quantized_kv_start=0)] for p in prompts]
    full = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=10)] for p in prompts]
    quantize_kv(model, 4, 64, 0)
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=2, prefill_batch_size=2)
    uids = list(gen.insert(prompts, max_tokens=[10, 10]))
    got: dict[int, list[int]] = {u: [] for u in uids}
    while out := gen.next_generated():
        for r in out:
            got[r.uid].append(r.token)
    assert [got[u] for u in uids] == want, (family, full)
