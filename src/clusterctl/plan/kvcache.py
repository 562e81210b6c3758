"""The KV cache of every layer for one sequence, from config.json alone (no MLX: the launch re-check runs it too).

What each layer's cache keeps follows mlx-lm's class for the model (mlx_lm/models/<arch>.py: make_cache() and what
the attention passes to cache.update_and_fetch), checked against the caches' nbytes in tests/plan/test_kv.py.
A class not named below is counted as full attention on every layer (2 x KV heads x head size per token, the
whole context): a sliding window or a state layer it may have is over-counted, never under-counted, except MLA,
which any config with kv_lora_rank is taken to be.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterctl.errors import ConfigError
from clusterctl.plan.configfields import MAX_LAYERS, MAX_SIZE, TORCH_DTYPE_BYTES
from clusterctl.plan.configfields import cfg as _cfg, int_cfg as _int_cfg
from clusterctl.protocol.deployment import KvLayer
from clusterctl.modelfiles.folder import text_config

# mlx-lm's MODEL_REMAPPING entries that matter here (mlx_lm/utils.py; tests/plan/test_kv.py checks they agree)
KV_REMAP = {"mistral": "llama", "kimi_k2": "deepseek_v3", "joyai_llm_flash": "deepseek_v3", "iquestcoder": "llama",
            "xverse": "llama"}
# sliding layers by pattern: layer i is global when i % pattern == pattern - 1; (default window, default pattern)
_PATTERN = {"gemma3_text": (512, 6), "gemma3": (512, 6), "cohere2": (4096, 4)}
# sliding layers by ``layer_types``: (default window, is the type sliding?, the class's layer types when not given)
_SLIDING = lambda t: t == "sliding_attention"  # noqa: E731
_NOT_FULL = lambda t: t != "full_attention"  # noqa: E731
_LAYER_TYPES = {
    "llama": (None, _SLIDING, lambda n: ["full_attention"] * n),
    "ministral3": (None, _SLIDING, lambda n: ["full_attention"] * n),
    "gpt_oss": (128, _NOT_FULL, lambda n: ["sliding_attention", "full_attention"] * (n // 2)),
    "olmo3": (None, _NOT_FULL,
              lambda n: ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]),
}
# multi-head latent attention (MLA). mlx-lm's deepseek_v2, minicpm3 and youtu_llm expand the latent and cache full
# keys (nope + rope dims) and values per head; the others cache the latent and the RoPE key, shared by all heads.
_MLA_HEADS = {"deepseek_v2", "minicpm3", "youtu_llm"}
_MLA_INDEXER = {"deepseek_v32", "glm_moe_dsa"}  # also the sparse-attention indexer's keys (stored as keys and values)
# linear attention (gated delta net) on every layer but each full_attention_interval-th: a fixed state
_LINEAR = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
# Bailing's hybrids: MLA on each layer_group_size-th layer and on the layers after the last whole group, linear
# attention on the others (bailing_moe_v3: KDA, bailing_hybrid: gated linear attention)
_BAILING = {"bailing_moe_v3", "bailing_hybrid"}
# mlx-lm's MODEL_ARCHITECTURE_REMAPPING: (model_type, an ``architectures`` entry) -> its class (tests/plan/test_kv.py)
KV_ARCH_REMAP = {("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3"}


def kv_arch(config: dict) -> str:
    """The mlx-lm class (module name) whose caches the estimate follows: the top-level model_type as mlx-lm's
    loader remaps it, or the text model's (``text_config``) when only that one is known here."""
    known = set(_PATTERN) | set(_LAYER_TYPES) | _MLA_HEADS | _MLA_INDEXER | _LINEAR | _BAILING | {"deepseek_v3"}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    names = [str(config.get("model_type") or ""), str(text.get("model_type") or "")]
    archs = config.get("architectures")
    archs = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else []
    by_arch = next((KV_ARCH_REMAP[(names[0], a)] for a in archs
                    if isinstance(a, str) and (names[0], a) in KV_ARCH_REMAP), None)
    names = [by_arch or KV_REMAP.get(names[0], names[0]), KV_REMAP.get(names[1], names[1])]
    return next((n for n in names if n in known), names[0])


def kv_layers(config: dict, dtype_bytes: int, *, folder: str | os.PathLike = "<model>") -> list[KvLayer]:
    """Every layer's KV cache for one sequence (one batch slot), from config.json alone (see the table above):
    bytes per token, a sliding layer's window, a linear-attention layer's fixed state. ``dtype_bytes``: one cached
    number (``kv_dtype_bytes``); ``folder`` names the model in errors."""
    folder = Path(folder)
    text = text_config(config)
    arch = kv_arch(config)
    n = _int_cfg(text, folder, "num_hidden_layers", "n_layers", "num_layers", minimum=1, maximum=MAX_LAYERS)
    heads = _int_cfg(text, folder, "num_attention_heads", "n_heads", minimum=1)
    hidden = _int_cfg(text, folder, "hidden_size", "d_model", "dim", minimum=1)
    if n is None or heads is None or hidden is None:
        raise ConfigError(f"{folder}/config.json: num_hidden_layers / hidden_size / num_attention_heads missing")
    kv_heads = _int_cfg(text, folder, "num_key_value_heads", "n_kv_heads", default=heads, minimum=1)
    head_dim = _int_cfg(text, folder, "head_dim", default=max(1, hidden // heads), minimum=1)
    full = KvLayer(kind="full", bytes_per_token=2 * kv_heads * head_dim * dtype_bytes)

    def sliding(window: int | None) -> KvLayer:
        if window is None:  # no usable window: count the whole context
            return full
        return KvLayer(kind="sliding", bytes_per_token=full.bytes_per_token, window=window)

    def window_of(default: int | None) -> int | None:
        v = _cfg(text, "sliding_window")
        if v is None:
            return default
        return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIZE else None

    rank = _int_cfg(text, folder, "kv_lora_rank", minimum=1)
    if arch in _BAILING:
        return _bailing_layers(text, folder, arch, n, heads, hidden, dtype_bytes)
    if rank is not None:
        rope = _int_cfg(text, folder, "qk_rope_head_dim", default=64, minimum=0)
        if arch in _MLA_HEADS:
            nope = _int_cfg(text, folder, "qk_nope_head_dim", default=128, minimum=0)
            v_dim = (max(1, hidden // heads) if arch == "minicpm3"
                     else _int_cfg(text, folder, "v_head_dim", default=128, minimum=1))
            return [KvLayer(kind="mla-heads", bytes_per_token=heads * (nope + rope + v_dim) * dtype_bytes)] * n
        per_token = rank + rope
        if arch in _MLA_INDEXER:
            per_token += 2 * _int_cfg(text, folder, "index_head_dim", default=128, minimum=1)
        return [KvLayer(kind="mla", bytes_per_token=per_token * dtype_bytes, sharded=False)] * n
    if arch in _PATTERN:
        window = window_of(_PATTERN[arch][0])
        pattern = _int_cfg(text, folder, "sliding_window_pattern", default=_PATTERN[arch][1], minimum=1)
        return [full if i % pattern == pattern - 1 else sliding(window) for i in range(n)]
    if arch in _LAYER_TYPES:
        default_window, is_sliding, default_types = _LAYER_TYPES[arch]
        window = window_of(default_window)
        types = _cfg(text, "layer_types")
        if not isinstance(types, list):
            types = default_types(n)
        return [sliding(window) if i < len(types) and isinstance(types[i], str) and is_sliding(types[i]) else full
                for i in range(n)]
    if arch in _LINEAR:
        # mlx-lm qwen3_next / qwen3_5 GatedDeltaNet: a conv state of (kernel - 1) x (2 key dims + value dims) in the
        # activations' dtype, and a recurrent state of value heads x value dim x key dim in float32
        interval = _int_cfg(text, folder, "full_attention_interval", default=4, minimum=1)
        nv = _int_cfg(text, folder, "linear_num_value_heads", default=64, minimum=1)
        nk = _int_cfg(text, folder, "linear_num_key_heads", default=16, minimum=1)
        dk = _int_cfg(text, folder, "linear_key_head_dim", default=192, minimum=1)
        dv = _int_cfg(text, folder, "linear_value_head_dim", default=128, minimum=1)
        kernel = _int_cfg(text, folder, "linear_conv_kernel_dim", default=4, minimum=1)
        state = (kernel - 1) * (2 * nk * dk + nv * dv) * dtype_bytes + nv * dv * dk * 4
        linear = KvLayer(kind="linear", state_bytes=state)
        return [full if (i + 1) % interval == 0 else linear for i in range(n)]
    return [full] * n


def _bailing_layers(text: dict, folder: Path, arch: str, n: int, heads: int, hidden: int,
                   dtype_bytes: int) -> list[KvLayer]:
    """mlx-lm's bailing_moe_v3 / bailing_hybrid: an MLA layer caches the latent and the RoPE key; a KDA layer
    (v3) keeps three short-conv states of (kernel - 1) x heads x head size in the activations' dtype and a float32
    recurrent state of heads x head size x head size; a gated-linear-attention layer only the recurrent state."""
    group = _int_cfg(text, folder, "layer_group_size", default=4, minimum=1)
    rank = _int_cfg(text, folder, "kv_lora_rank", default=512, minimum=1)
    rope = _int_cfg(text, folder, "qk_rope_head_dim", default=64, minimum=0)
    head_dim = _int_cfg(text, folder, "head_dim", minimum=1) or (128 if arch == "bailing_moe_v3" else
                                                                  max(1, hidden // heads))  # the classes' defaults
    state = heads * head_dim * head_dim * 4
    if arch == "bailing_moe_v3":
        kernel = _int_cfg(text, folder, "short_conv_kernel_size", default=4, minimum=1)
        state += 3 * (kernel - 1) * heads * head_dim * dtype_bytes
    mla = KvLayer(kind="mla", bytes_per_token=(rank + rope) * dtype_bytes, sharded=False)
    linear = KvLayer(kind="linear", state_bytes=state)
    return [mla if (i + 1) % group == 0 or i >= n // group * group else linear for i in range(n)]


FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def kv_dtype_bytes(dtypes: dict[str, int], path_dtypes: set[str], config: dict) -> int:
    """Bytes of one cached number. mlx-lm loads weights as stored (it does not cast to ``torch_dtype``), the hidden
    state starts in the embedding's dtype (its scales' when quantized) and a float32 norm weight promotes it to
    float32: the widest of those. Without them, the dtype most weight bytes have; then torch_dtype; else 2."""
    if path_dtypes:
        return max(FLOAT_BYTES[d] for d in path_dtypes)
    if dtypes:
        return FLOAT_BYTES[max(sorted(dtypes), key=dtypes.get)]
    return TORCH_DTYPE_BYTES.get(str(_cfg(text_config(config), "torch_dtype", "dtype", default="")), 2)
