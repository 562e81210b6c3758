"""The stage blocks (rank/engine/stage.py) in one process: what a block another rank runs keeps of its cache."""

from __future__ import annotations

from archmodels import config_of


def _prefill_masks(model, monkeypatch) -> list:
    """The state layers' masks the model builds while mlx-lm processes three prompts of different lengths
    together (right-padded) in chunks of 16 tokens (the way overlap.py hands a group of prompts to mlx-lm's
    PromptProcessingBatch, with a 2,048-token step); then each row's caches as a finished row's are handed back
    (what rank/engine/batch.py and overlap.py ask for when a request ends)."""
    import mlx.core as mx
    import mlx_lm.models.bailing_moe_v3 as arch
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.base import create_ssm_mask
    from mlx_lm.models.cache import make_prompt_cache

    masks = []

    def record(h, cache=None):
        m = create_ssm_mask(h, cache)
        masks.append(None if m is None else m.tolist())
        return m

    monkeypatch.setattr(arch, "create_ssm_mask", record)
    batch = PromptProcessingBatch(model, [0, 1, 2], [make_prompt_cache(model) for _ in range(3)],
                                  prefill_step_size=16)
    batch.prompt([list(range(1, 41)), list(range(3, 24)), list(range(5, 55))])
    for i in range(3):
        mx.eval([c.extract(i).state for c in batch.prompt_cache])
    return masks


def test_a_skipped_state_layer_keeps_the_mask_bookkeeping_of_its_cache(monkeypatch):
    """Bailing V3 builds every linear-attention layer's padding mask from the first one's cache (layer 0). A rank
    that runs layers 2-3 skips layer 0, whose cache must still count down each row's remaining length per
    prompt chunk: the masks are the ones the whole model builds, and a finished row's caches can be handed back."""
    import mlx.core as mx

    from clusterctl.rank.engine.stage import Skip, split_blocks
    from clusterctl.modelfiles.archs import build_lazy

    mx.random.seed(0)
    whole = build_lazy(config_of("bailing_hybrid"))
    mx.eval(whole.parameters())
    want = _prefill_masks(whole, monkeypatch)
    assert len(want) == 4 and not all(all(row) for row in want[-1])  # the last chunk masks the shorter rows

    part = build_lazy(config_of("bailing_hybrid"))
    part.update(whole.parameters())
    split_blocks(part, 0, 1, 2, 4)
    assert [isinstance(b, Skip) for b in part.layers] == [True, True, False, False]
    assert _prefill_masks(part, monkeypatch) == want
