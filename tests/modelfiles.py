"""Test helper: write real model folders (config.json + safetensors) of any shape, without MLX.

The data bytes are zeros unless asked otherwise; planning only reads headers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], *, fill: bytes = b"\0",
                      pad: int = 0) -> None:
    header = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = DTYPE_SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode() + b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write((fill * (offset // len(fill) + 1))[:offset])


def layer_tensors(i: int, hidden: int, kv_dim: int, inter: int, dtype: str = "F16", quant_bits: int | None = None):
    p = f"model.layers.{i}."
    mats = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_dim, hidden),
            "self_attn.v_proj": (kv_dim, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    out = {}
    for name, (o, i_) in mats.items():
        if quant_bits:
            out[p + name + ".weight"] = ("U32", [o, i_ * quant_bits // 32])
            out[p + name + ".scales"] = (dtype, [o, i_ // 64])
            out[p + name + ".biases"] = (dtype, [o, i_ // 64])
        else:
            out[p + name + ".weight"] = (dtype, [o, i_])
    out[p + "input_layernorm.weight"] = (dtype, [hidden])
    out[p + "post_attention_layernorm.weight"] = (dtype, [hidden])
    return out


def make_model(folder: Path, *, layers: int = 8, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               inter: int = 128, vocab: int = 256, shards: int = 1, model_type: str = "qwen2",
               dtype: str = "F16", quant_bits: int | None = None, tie: bool = False,
               embed_bits: int | None = None) -> Path:
    """``quant_bits``: the layers quantized (packed U32 + scales + biases, groups of 64); ``embed_bits``: the
    embedding too, at its own bits (mlx-lm's per-module override in config ``quantization``)."""
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
              "vocab_size": vocab, "tie_word_embeddings": tie, "torch_dtype": "float16" if dtype == "F16" else "float32",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    if quant_bits:
        config["quantization"] = {"group_size": 64, "bits": quant_bits}
    if embed_bits:
        config.setdefault("quantization", {"group_size": 64, "bits": 4})["model.embed_tokens"] = {
            "group_size": 64, "bits": embed_bits}
        embed = {"model.embed_tokens.weight": ("U32", [vocab, hidden * embed_bits // 32]),
                 "model.embed_tokens.scales": (dtype, [vocab, hidden // 64]),
                 "model.embed_tokens.biases": (dtype, [vocab, hidden // 64])}
    else:
        embed = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {**embed, "model.norm.weight": (dtype, [hidden])}
    if not tie:
        tensors["lm_head.weight"] = (dtype, [vocab, hidden])
    for i in range(layers):
        tensors.update(layer_tensors(i, hidden, kv_heads * head_dim, inter, dtype, quant_bits))
    names = list(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
        return folder
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        write_safetensors(folder / fname, part)
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
