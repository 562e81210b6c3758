"""Tiny random-weight models of many architectures, built from mlx-lm's own model classes (no downloads).

Each is a real model folder mlx-lm loads (config.json, safetensors, index) with the tiny test tokenizer of
``clusterctl model tiny``; the weights are random, so the text is noise, but every architecture's own code
(masks, sliding windows, norms, scalings) runs, which is what splitting it over ranks must keep.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BASE = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 2048,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},  # mlx-lm builds it with its llama class
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 6, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                    "rope_local_base_freq": 10000.0},
    "phi3": {},
    "olmo2": {},
    "starcoder2": {"norm_epsilon": 1e-5},
    "granite": {"logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5, "attention_bias": False, "mlp_bias": False},
}


def config_of(family: str, layers: int = 4) -> dict:
    return {"model_type": family, **BASE, **FAMILIES[family], "num_hidden_layers": layers}


def build(family: str, folder: Path, tokenizer_from: Path, *, layers: int = 4, seed: int = 0) -> Path:
    """Write the model once (reused when its config matches)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import save_config, save_model

    from clusterctl.plan.archs import build_lazy

    folder = Path(folder)
    config = config_of(family, layers)
    done = folder / "config.json"
    if done.exists() and json.loads(done.read_text()).get("_test_config") == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build_lazy(config)
    # a wider spread than the classes' init, so that different tokens win (not one token forever)
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    assert tree_flatten(model.parameters())
    save_model(folder, model, donate_model=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, folder / name)
    save_config({**config, "_test_config": config}, folder / "config.json")
    return folder
