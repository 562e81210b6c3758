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
    # Bailing V3's hybrid (mlx-lm's bailing_moe_v3 class, picked by ``architectures``): linear attention (KDA,
    # a state cache) on layers 0 and 2, MLA on 1 and 3, experts after a dense first layer
    "bailing_hybrid": {"architectures": ["BailingMoeV3ForCausalLM"], "layer_group_size": 2,
                       "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "num_experts": 4,
                       "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                       "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.0, "q_lora_rank": 24,
                       "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                       "short_conv_kernel_size": 4},
}


# families that mlx-lm cannot decode in batches (served one request at a time): not in FAMILIES
UNBATCHABLE: dict[str, dict] = {
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 6},
}


# wrapper models: the text model sits inside (``language_model``), its sizes in ``text_config``
WRAPPERS: dict[str, str] = {"mistral3": "llama"}

# hybrids with state caches whose class has mlx-lm's own pipeline(), which clusterctl splits them with; keyed by a
# test name, each config carries its model_type. Linear attention on every other layer
MLX_PIPELINED: dict[str, dict] = {
    "qwen3_next": {"model_type": "qwen3_next", "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                   "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "shared_expert_intermediate_size": 32, "mlp_only_layers": [],
                   "moe_intermediate_size": 32, "partial_rotary_factor": 0.5},
    # model_type bailing_hybrid without Bailing V3's ``architectures``: mlx-lm's bailing_hybrid class (gated
    # linear attention beside MLA)
    "bailing_hybrid_gla": {**{k: v for k, v in FAMILIES["bailing_hybrid"].items() if k != "architectures"},
                           "model_type": "bailing_hybrid", "group_norm_size": 1},
}


def config_of(family: str, layers: int = 4) -> dict:
    if family in MLX_PIPELINED:
        return {**BASE, **MLX_PIPELINED[family], "num_hidden_layers": layers}
    if family in WRAPPERS:
        return {"model_type": family, "text_config": {**config_of(WRAPPERS[family], layers)}}
    extra = FAMILIES[family] if family in FAMILIES else UNBATCHABLE[family]
    return {"model_type": family, **BASE, **extra, "num_hidden_layers": layers}


def build(family: str, folder: Path, tokenizer_from: Path | None, *, layers: int = 4, seed: int = 0) -> Path:
    """Write the model once (reused when its config matches)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import save_config, save_model

    from clusterctl.modelfiles.archs import build_lazy

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
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_from is not None else ():  # None: plan only
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


# ---- released layouts: the config keys and tensor names of the checkpoints as their families publish them ----
#
# Built from mlx-lm's class like the others, then written back the way the released checkpoint holds them, so the
# loader's own ``sanitize`` (and clusterctl's plan and weight checks, which run it) meet the real names.

_YARN = {"rope_type": "yarn", "type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
         # small, so that llama-4 attention scaling (1 + beta * log(1 + floor(pos / this))) changes within a prompt
         "original_max_position_embeddings": 8}
_VISION = {"model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2,
           "intermediate_size": 64, "head_dim": 16, "image_size": 64, "patch_size": 16, "num_channels": 3,
           "rope_theta": 10000.0}


def _text(extra: dict, model_type: str) -> dict:
    return {"model_type": model_type, **{k: v for k, v in BASE.items() if k != "rope_theta"}, **extra}


RELEASED: dict[str, dict] = {
    # Ministral-3 (3B/8B/14B-2512): Mistral3ForConditionalGeneration around a ministral3 text model, yarn RoPE in
    # ``rope_parameters`` with llama-4 attention scaling; tensors under ``model.language_model.``, the head at
    # ``lm_head``, a Pixtral vision tower and projector beside them (mlx-lm drops those)
    "ministral3": {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                   "image_token_index": 10, "spatial_merge_size": 2, "projector_hidden_act": "gelu",
                   "multimodal_projector_bias": False, "vision_feature_layer": -1, "vision_config": _VISION,
                   "text_config": _text({"rope_parameters": {**_YARN, "rope_theta": 1000000.0, "factor": 16.0},
                                         "max_position_embeddings": 16 * 8,
                                         "sliding_window": None, "hidden_act": "silu"}, "ministral3")},
    # Mistral-4 (Mistral-Small-4-119B-2603): the same wrapper around mistral4 (MLA with q/kv LoRA, experts, yarn
    # with llama-4 scaling); attention keeps ``kv_b_proj`` (mlx-lm absorbs it), experts are fused
    # (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: one tensor each for all experts)
    "mistral4": {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                 "image_token_index": 10, "spatial_merge_size": 2, "projector_hidden_act": "gelu",
                 "multimodal_projector_bias": False, "vision_feature_layer": -1, "vision_config": _VISION,
                 "text_config": _text({
                     "num_key_value_heads": 4, "head_dim": 24, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
                     "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                     "first_k_dense_replace": 1, "rope_interleave": True, "attention_bias": False,
                     "max_position_embeddings": 128 * 8,
                     "rope_parameters": {**_YARN, "rope_theta": 10000.0, "factor": 128.0,
                                         "partial_rotary_factor": 1 / 3}}, "mistral4")},
    # GLM-4.5 / 4.6 / 4.7: one tensor per expert, and the multi-token-prediction layer after the last one
    # (``model.layers.<num_hidden_layers>.``: a whole decoder layer plus eh_proj, enorm, hnorm, embed_tokens and
    # shared_head), which mlx-lm drops
    "glm4_moe": {**config_of("glm4_moe"), "architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1},
}


def _vision_tensors(vision: dict) -> dict:
    import mlx.core as mx

    d, f = vision["hidden_size"], vision["intermediate_size"]
    out = {"model.vision_tower.patch_conv.weight": mx.zeros((d, 16, 16, 3)),
           "model.vision_tower.ln_pre.weight": mx.ones((d,)),
           "model.multi_modal_projector.norm.weight": mx.ones((d,)),
           "model.multi_modal_projector.patch_merger.merging_layer.weight": mx.zeros((d, 4 * d)),
           "model.multi_modal_projector.linear_1.weight": mx.zeros((BASE["hidden_size"], d)),
           "model.multi_modal_projector.linear_2.weight": mx.zeros((BASE["hidden_size"], BASE["hidden_size"]))}
    for i in range(vision["num_hidden_layers"]):  # more vision layers than text ones, as in Ministral-3 3B
        p = f"model.vision_tower.transformer.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"attention.{m}.weight"] = mx.zeros((d, d))
        for m, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            out[p + f"feed_forward.{m}.weight"] = mx.zeros(shape)
        out[p + "attention_norm.weight"] = mx.ones((d,))
        out[p + "ffn_norm.weight"] = mx.ones((d,))
    return out


def _released_names(name: str, config: dict, weights: dict) -> dict:
    """mlx-lm's parameter names (what ``save_model`` writes) -> the released checkpoint's."""
    import re

    import mlx.core as mx

    out = {}
    if name == "glm4_moe":
        for k, w in weights.items():
            m = re.match(r"(.*)\.switch_mlp\.(\w+)\.weight$", k)
            if m:
                for e in range(w.shape[0]):
                    out[f"{m.group(1)}.experts.{e}.{m.group(2)}.weight"] = w[e]
            else:
                out[k] = w
        n = config["num_hidden_layers"]
        for k, w in list(out.items()):  # the MTP layer: a copy of the last decoder layer, plus its own parts
            if k.startswith(f"model.layers.{n - 1}."):
                out[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.", 1)] = w
        h, v = config["hidden_size"], config["vocab_size"]
        p = f"model.layers.{n}."
        out.update({p + "eh_proj.weight": mx.zeros((h, 2 * h)), p + "enorm.weight": mx.ones((h,)),
                    p + "hnorm.weight": mx.ones((h,)), p + "embed_tokens.weight": weights["model.embed_tokens.weight"],
                    p + "shared_head.norm.weight": mx.ones((h,)),
                    p + "shared_head.head.weight": weights["lm_head.weight"]})
        return out
    text = config["text_config"]
    for k, w in weights.items():
        k = k.replace("language_model.model.", "model.language_model.", 1).replace("language_model.lm_head.",
                                                                                    "lm_head.", 1)
        if name == "mistral4":
            if m := re.match(r"(.*)\.switch_mlp\.(gate|up)_proj\.weight$", k):
                if m.group(2) == "gate":
                    up = weights[k.replace("model.language_model.", "language_model.model.", 1)
                                 .replace("gate_proj", "up_proj")]
                    out[f"{m.group(1)}.experts.gate_up_proj"] = mx.concatenate([w, up], axis=1)
                continue
            if m := re.match(r"(.*)\.switch_mlp\.down_proj\.weight$", k):
                out[f"{m.group(1)}.experts.down_proj"] = w
                continue
            if m := re.match(r"(.*)\.self_attn\.(embed_q|unembed_out)\.weight$", k):
                if m.group(2) == "embed_q":  # kv_b_proj: per head, the nope rows of keys then the value rows
                    wv = weights[k.replace("model.language_model.", "language_model.model.", 1)
                                 .replace("embed_q", "unembed_out")]
                    kv_b = mx.concatenate([w.swapaxes(-1, -2), wv], axis=1)
                    out[f"{m.group(1)}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, text["kv_lora_rank"])
                continue
        out[k] = w
    out.update(_vision_tensors(config["vision_config"]))
    return out


def build_released(name: str, folder: Path, tokenizer_from: Path | None, *, seed: int = 0) -> Path:
    """A model of ``RELEASED[name]``: mlx-lm's class with random weights, written in the released layout
    (``tokenizer_from`` None: no tokenizer, for plans only)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from clusterctl.atomic import atomic_write_json
    from clusterctl.modelfiles.archs import build_lazy

    folder = Path(folder)
    config = RELEASED[name]
    done = folder / "config.json"
    if done.exists() and json.loads(done.read_text()).get("_test_config") == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build_lazy(json.loads(json.dumps(config)))  # mlx-lm's ModelArgs may fill in the dicts it is given
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out = _released_names(name, config, weights)
    mx.eval(out)
    mx.save_safetensors(str(folder / "model.safetensors"), out, metadata={"format": "pt"})
    atomic_write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": {
        n: "model.safetensors" for n in sorted(out)}})
    for f in ("tokenizer.json", "tokenizer_config.json") if tokenizer_from else ():
        shutil.copy(Path(tokenizer_from) / f, folder / f)
    (folder / "config.json").write_text(json.dumps({**config, "_test_config": config}, indent=1))
    return folder


# DeepSeek-V3 (and R1, V3.1) as released: FP8 weights (``F8_E4M3``, one ``weight_scale_inv`` per 128 x 128 block),
# ``kv_b_proj``, one tensor per expert, the multi-token-prediction layer 61 (mlx-lm drops ``model.layers.61`` by
# that number, so the model keeps the real 61 layers, at toy width). Planned only: mlx on a CPU cannot run
# bfloat16 experts (GatherMM supports float32 only), so one mlx-lm process cannot serve it here
DEEPSEEK_V3_FP8 = {**config_of("deepseek_v3", 61), "architectures": ["DeepseekV3ForCausalLM"],
                   "num_nextn_predict_layers": 1, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}}


def write_deepseek_v3_fp8_headers(folder: Path) -> Path:
    """Header-only files (zeros; planning reads headers) of DEEPSEEK_V3_FP8 in the released names and dtypes."""
    import re

    from mlx.utils import tree_flatten

    from clusterctl.modelfiles.archs import build_lazy
    from modelfiles import write_safetensors

    config = DEEPSEEK_V3_FP8
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    out: dict[str, tuple[str, list[int]]] = {}

    def linear(name: str, shape: list[int]) -> None:
        fp8 = ".layers." in name and not name.endswith("mlp.gate.weight")  # the router stays in 16 bits
        out[name] = ("F8_E4M3" if fp8 else "BF16", shape)
        if fp8:
            out[name + "_scale_inv"] = ("F32", [-(-shape[0] // 128), -(-shape[1] // 128)])

    for name, p in tree_flatten(build_lazy(config).parameters()):
        shape = list(p.shape)
        if m := re.match(r"(.*)\.switch_mlp\.(\w+)\.weight$", name):
            for e in range(shape[0]):
                linear(f"{m.group(1)}.experts.{e}.{m.group(2)}.weight", shape[1:])
        elif m := re.match(r"(.*)\.self_attn\.embed_q\.weight$", name):
            linear(f"{m.group(1)}.self_attn.kv_b_proj.weight", [heads * (nope + v), config["kv_lora_rank"]])
        elif ".unembed_out." in name:
            continue
        elif len(shape) == 2:
            linear(name, shape)
        else:
            out[name] = ("F32" if "e_score_correction_bias" in name else "BF16", shape)
    h, last = config["hidden_size"], config["num_hidden_layers"]
    for name, (dtype, shape) in list(out.items()):
        if name.startswith(f"model.layers.{last - 1}."):
            out[name.replace(f"model.layers.{last - 1}.", f"model.layers.{last}.", 1)] = (dtype, shape)
    p = f"model.layers.{last}."
    for name, shape in ((p + "eh_proj.weight", [h, 2 * h]), (p + "embed_tokens.weight", [config["vocab_size"], h]),
                        (p + "shared_head.head.weight", [config["vocab_size"], h])):
        linear(name, shape) if name.endswith("eh_proj.weight") else out.update({name: ("BF16", shape)})
    out.update({p + n: ("BF16", [h]) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", out)
    (folder / "config.json").write_text(json.dumps(config))
    return folder

