"""Small LoRA adapters in mlx-lm's format (what ``mlx_lm.lora`` writes: ``adapters.safetensors`` with the LoRA
layers' ``lora_a``/``lora_b`` under the model's own parameter names, and ``adapter_config.json``), made without
training: mlx-lm's own ``linear_to_lora_layers`` on the model, then non-zero B matrices, so the adapted model's
tokens differ from the base model's."""

from __future__ import annotations

import json
from pathlib import Path


def build_adapter(model_path: Path, out: Path, *, num_layers: int = 2, rank: int = 4, scale: float = 20.0,
                  seed: int = 3, dropout: float = 0.0, keys: list[str] | None = None, dora: bool = False) -> Path:
    """``dropout``: what the trainer used (mlx_lm.lora's configs: 0.05 to 0.1); served, a LoRA layer never drops.
    ``keys``: the blocks' modules it targets (None: every linear, as mlx_lm.lora's default)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    out.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(Path(model_path), strict=False)  # header-only test models lack biases
    model.freeze()
    params = {"rank": rank, "dropout": dropout, "scale": scale, **({"keys": keys} if keys is not None else {})}
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    mx.random.seed(seed)
    weights = {k: (mx.random.normal(v.shape) * 0.05).astype(v.dtype) for k, v in
               tree_flatten(model.trainable_parameters())}
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers, "lora_parameters": params}))
    return out


def adapted_tokens(model: Path, adapter: Path, prompt: str, n: int) -> list[int]:
    """One process, plain mlx-lm with the adapter: the greedy tokens ``stream_generate`` produces (EOS excluded)."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    m, tok = load(str(model), adapter_path=str(adapter))
    out = []
    for r in stream_generate(m, tok, prompt, max_tokens=n, sampler=make_sampler(0.0)):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        out.append(r.token)
    return out


def adapted_logits(model: Path, adapter: Path | None, tokens: list[int], *, rank_side: bool):
    """The last position's logits of ``tokens`` through the model with the adapter: one plain ``mlx_lm.load``
    (``rank_side`` False; ``adapter`` None: the base model), or the base model with the rank's ``apply_adapter``
    on it (rank/engine/adapter.py)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import load_model

    if rank_side:
        from clusterctl.rank.engine.adapter import apply_adapter

        m, _ = load_model(Path(model))
        apply_adapter(m, len(m.layers), str(adapter))
    else:
        m, _ = load(str(model), adapter_path=None if adapter is None else str(adapter))
    out = m(mx.array([tokens]))[0, -1].astype(mx.float32)
    mx.eval(out)
    return out
