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
    # mixture of experts
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "glm4_moe": {"moe_intermediate_size": 32, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                 "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.0,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1, "rope_scaling": None, "use_qk_norm": True,
                 "attention_bias": False, "partial_rotary_factor": 0.5},
    # multi-head latent attention (MLA) with experts
    "deepseek_v2": {"moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1.0,
                                                      "mscale_all_dim": 0.0, "beta_fast": 32, "beta_slow": 1,
                                                      "original_max_position_embeddings": 4096}},
    "deepseek_v3": {"moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 1},
}


# families that mlx-lm cannot decode in batches (served one request at a time): not in FAMILIES
UNBATCHABLE: dict[str, dict] = {
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 6},
}


# wrapper models: the text model sits inside (``language_model``), its sizes in ``text_config``
WRAPPERS: dict[str, str] = {"mistral3": "llama"}


def config_of(family: str, layers: int = 4) -> dict:
    if family in WRAPPERS:
        return {"model_type": family, "text_config": {**config_of(WRAPPERS[family], layers)}}
    extra = FAMILIES[family] if family in FAMILIES else UNBATCHABLE[family]
    return {"model_type": family, **BASE, **extra, "num_hidden_layers": layers}


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


def build_hf_layout(family: str, folder: Path, tokenizer_from: Path, *, mtp: bool = False) -> Path:
    """A mixture-of-experts model as Hugging Face ships it: one tensor per expert (``mlp.experts.E.gate_proj``),
    which mlx-lm's ``sanitize`` stacks when it loads; with ``mtp`` also a multi-token-prediction layer after the
    last one (``model.layers.<num_hidden_layers>.*``, as GLM-4.5 checkpoints carry), which it drops."""
    import re

    import mlx.core as mx

    from clusterctl.atomic import atomic_write_json

    src = build(family, Path(str(folder) + "-mlx"), tokenizer_from)
    folder = Path(folder)
    config = json.loads((src / "config.json").read_text())
    if (folder / "config.json").exists() and json.loads((folder / "config.json").read_text()) == {**config, "_hf": mtp}:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(src / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        m = re.match(r"(.*)\.switch_mlp\.(\w+)\.(weight|scales|biases)$", name)
        if m:
            for e in range(w.shape[0]):
                out[f"{m.group(1)}.experts.{e}.{m.group(2)}.{m.group(3)}"] = w[e]
        else:
            out[name] = w
    if mtp:
        last = config["num_hidden_layers"] - 1
        for name, w in list(out.items()):
            if name.startswith(f"model.layers.{last}."):
                out[name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}.", 1)] = w
    mx.save_safetensors(str(folder / "model.safetensors"), out, metadata={"format": "mlx"})
    atomic_write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": {
        n: "model.safetensors" for n in out}})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    (folder / "config.json").write_text(json.dumps({**config, "_hf": mtp}))
    return folder
