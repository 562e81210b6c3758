"""The KV cache stored quantized (plan --kv-bits): its size, and the models whose caches can be.

mlx-lm's ``QuantizedKVCache`` keeps, per cached number, ``bits`` bits packed in uint32 words, and per group of
``group_size`` numbers along the head dimension a scale and a bias in the keys' dtype (``mx.quantize``, affine).
A sequence's cache turns quantized whole once it holds ``quantized_kv_start`` tokens (mlx-lm's
``maybe_quantize_kv_cache``; rank/engine/kvquant.py does the same on every rank), so over its life a sequence of C tokens
holds at most max(the full-precision cache of min(C, start) tokens, the quantized cache of C tokens).

Only caches mlx-lm can quantize qualify: every layer a plain ``KVCache`` of keys and values per head (the
``full`` estimate of plan/kvcache.py). A sliding window (``RotatingKVCache.to_quantized`` is not implemented),
an MLA latent (attended by the model's own code, not the quantized attention) and linear-attention or state
layers are refused by name, and so is a head size the group size does not divide (``mx.quantize`` needs it).
"""

from __future__ import annotations

from clusterctl.errors import ConfigError
from clusterctl.modelfiles.archs import cache_kinds
from clusterctl.protocol.deployment import KvLayer, PlanOptions

_KIND_WHY = {"sliding": "sliding-window layers (mlx-lm's RotatingKVCache cannot be quantized)",
             "mla": "a compressed MLA latent (attended by the model's own code, not mlx-lm's quantized attention)",
             "mla-heads": "MLA keys and values (attended by the model's own code, not mlx-lm's quantized attention)",
             "linear": "linear-attention or state layers (a fixed state, not a key/value cache)"}


def quantized_layer(layer: KvLayer, options: PlanOptions, dtype_bytes: int) -> KvLayer:
    """The layer's cache stored quantized: bits/8 bytes per number, plus a scale and a bias (``dtype_bytes``
    each) per group of ``kv_group_size`` numbers."""
    numbers = layer.bytes_per_token // dtype_bytes  # keys + values of one token
    per_token = numbers * options.kv_bits // 8 + 2 * (numbers // options.kv_group_size) * dtype_bytes
    return layer.model_copy(update={"bytes_per_token": per_token})


def refuse(model_type: str, layers: list[KvLayer], head_dim: int, class_reason: str | None,
           options: PlanOptions) -> None:
    """Raise ConfigError naming why this model's KV cache cannot be stored quantized (nothing when it can)."""
    if options.kv_bits is None:
        return
    kinds = sorted({layer.kind for layer in layers if layer.kind != "full"})
    if kinds:
        why = "; ".join(_KIND_WHY.get(k, k) for k in kinds)
        raise ConfigError(f"--kv-bits: model type {model_type!r} keeps {why}: mlx-lm cannot quantize its KV cache",
                          hint="plan it without --kv-bits")
    if class_reason:
        raise ConfigError(f"--kv-bits: model type {model_type!r}: {class_reason}", hint="plan it without --kv-bits")
    if head_dim % options.kv_group_size:
        raise ConfigError(f"--kv-bits: model type {model_type!r} has heads of {head_dim} numbers, which "
                          f"--kv-group-size {options.kv_group_size} does not divide",
                          hint="use a --kv-group-size that divides the head size (32, 64 or 128)")


def class_blocker(model) -> str | None:
    """Why mlx-lm cannot quantize the caches this model (an instance of its class) makes, or None."""
    other = sorted({k for k in cache_kinds(model) if k != "KVCache"})
    if other:
        return f"its caches ({', '.join(other)}) are not plain KVCaches, which mlx-lm alone quantizes"
    return None
