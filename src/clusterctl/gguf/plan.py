"""What a llama-family GGUF file becomes before a byte is written: every check that can be made from its header
(architecture, tensor types, counts and shapes, RoPE), and the config.json, tensor renames, quantization block and
tokenizer of the import (``plan_import``). gguf/importer.py writes the folder from it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.gguf.reader import Header, TensorInfo
from clusterctl.gguf.check import (MAX_CONTEXT, MAX_HEAD_DIM, MAX_LAYERS, MAX_SIZE, MIN_CONTEXT, RMS_EPS,
                                  ROPE_FACTOR, ROPE_THETA, check_tensors, f32, meta)
from clusterctl.gguf.tokenizer import build_tokenizer

GROUP_SIZE = 32
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
FLOAT64 = 12  # a GGUF metadata value type


@dataclass
class ImportPlan:
    config: dict
    renames: dict[str, str]  # GGUF prefix ("blk.0.attn_q") -> mlx-lm prefix ("model.layers.0.self_attn.q_proj")
    tensor_types: dict[str, int]
    main_type: str
    parameters: int
    name: str
    tokenizer: object  # gguftokenizer.TokenizerFiles


def plan_import(h: Header, path: Path) -> ImportPlan:
    """Check everything that can be checked before loading, and derive config.json and the tensor names."""
    md = h.metadata
    counts = _supported(h, path)
    config, head_dim = _shape_config(h, path)
    vocab = config["vocab_size"]

    renames, rope_freqs, has_bias = check_tensors(h, path, config, head_dim)
    config.update(tie_word_embeddings="output" not in renames, attention_bias=has_bias["attention"],
                  mlp_bias=has_bias["mlp"])
    scaling = _rope_scaling(md, path, rope_freqs, config["rope_theta"], head_dim)
    if scaling:
        config["rope_scaling"] = scaling
    quant, main_type = _quantization(h, renames)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    # the norms' dtype decides the activations' (and the KV cache's): float32 norms promote everything to float32.
    # Kept so: on a CPU float16 is far slower (SmolLM2: 0.13 against 6 tokens/s) and its answer was wrong.
    norm = next(t for t in h.tensors if t.name == "output_norm.weight")
    config["torch_dtype"] = "float32" if norm.type == "F32" else "float16"

    tok = build_tokenizer(md, path, context_length=config["max_position_embeddings"])
    if tok.vocab_size != vocab:
        raise IntegrityError(f"{path}: {tok.vocab_size} tokens but the embedding has {vocab} rows")
    if tok.bos_token_id is not None:
        config["bos_token_id"] = tok.bos_token_id
    if tok.eos_token_ids:
        config["eos_token_id"] = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    name = md.get("general.name") if isinstance(md.get("general.name"), str) else path.stem
    return ImportPlan(config=config, renames=renames, tensor_types=dict(sorted(counts.items())), main_type=main_type,
                 parameters=sum(t.elements for t in h.tensors if t.name != "rope_freqs.weight"), name=name,
                 tokenizer=tok)


def _supported(h: Header, path: Path) -> Counter:
    """The file's tensor types (type -> count), once the architecture and every type are known importable."""
    md = h.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{path} is a {arch!r} model; only llama-architecture GGUFs (Llama, Mistral, SmolLM, "
                          f"TinyLlama ...) can be imported")
    f64 = next((k for k, t in h.value_types.items() if FLOAT64 in t), None)
    if f64 is not None:  # found by tests/gguf/test_fuzz_gguf.py: mx.load ends the process (SIGSEGV) on such a file
        raise ConfigError(f"{path}: metadata {f64} is a FLOAT64 value, which mlx's GGUF loader cannot read",
                          hint="write it as FLOAT32 (what llama.cpp's converters write)")
    if md.get("llama.expert_count"):
        raise ConfigError(f"{path} is a mixture-of-experts llama (Mixtral-style), which is not supported")
    counts = Counter(t.type for t in h.tensors)
    bad = {t: n for t, n in counts.items() if t not in SUPPORTED_TYPES}
    if bad:
        where = next(t.name for t in h.tensors if t.type in bad)
        raise ConfigError(
            f"{path} holds tensors of type {', '.join(f'{t} ({n})' for t, n in sorted(bad.items()))}, e.g. "
            f"{where}; only {', '.join(SUPPORTED_TYPES)} can be imported",
            hint="K-quants (Q4_K_M ...) put some tensors in Q6_K; re-quantize with llama.cpp: "
                 "llama-quantize --pure IN.gguf OUT.gguf Q4_0 (or Q8_0), or import an F16/Q8_0 file")
    return counts


def _shape_config(h: Header, path: Path) -> tuple[dict, int]:
    """config.json's sizes (layers, heads, head size, vocabulary, RoPE base, context) and the head size."""
    md = h.metadata
    # every count is checked before anything is built from it: a layer count by the tensors the file holds
    # (nine matrices and two norms per layer), the sizes by the tensors' shapes, which fit in the file
    layers = meta(md, "llama.block_count", path, hi=MAX_LAYERS, why=", as plan accepts")
    if 9 * layers + 2 > len(h.tensors):
        raise IntegrityError(f"{path}: llama.block_count says {layers} layers, which need at least {9 * layers + 2} "
                             f"tensors; the file has {len(h.tensors)}")
    hidden = meta(md, "llama.embedding_length", path)
    heads = meta(md, "llama.attention.head_count", path, hi=hidden)
    kv_heads = meta(md, "llama.attention.head_count_kv", path, default=heads, hi=heads)
    head_dim = meta(md, "llama.attention.key_length", path, required=False, hi=MAX_HEAD_DIM)
    if head_dim is None and hidden % heads:
        raise ConfigError(f"{path}: llama.embedding_length {hidden} is not a multiple of "
                          f"llama.attention.head_count {heads} (and no llama.attention.key_length says the head size)")
    head_dim = head_dim or hidden // heads
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"{path}: a head size of {head_dim} (llama.attention.key_length, or embedding_length / "
                          f"head_count) is not even and at most {MAX_HEAD_DIM}, as RoPE's pairs need")
    if meta(md, "llama.attention.value_length", path, required=False, hi=MAX_HEAD_DIM) not in (None, head_dim):
        raise ConfigError(f"{path}: key and value head sizes differ, which mlx-lm's llama does not support")
    rope_dims = meta(md, "llama.rope.dimension_count", path, required=False, hi=MAX_HEAD_DIM) or head_dim
    if rope_dims != head_dim:
        raise ConfigError(f"{path}: RoPE covers {rope_dims} of {head_dim} head dimensions; partial RoPE is not "
                          f"supported by mlx-lm's llama")
    if heads % kv_heads:
        raise ConfigError(f"{path}: {heads} attention heads (llama.attention.head_count) do not divide into "
                          f"{kv_heads} KV heads (llama.attention.head_count_kv)")
    embed = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise IntegrityError(f"{path}: no token embedding (token_embd.weight)")
    vocab = embed.shape[0]
    if not 1 <= vocab <= MAX_SIZE:
        raise IntegrityError(f"{path}: the token embedding has {vocab} rows (at most {MAX_SIZE})")
    if md.get("llama.vocab_size") not in (None, vocab):
        raise IntegrityError(f"{path}: llama.vocab_size {md['llama.vocab_size']} but the embedding has {vocab} rows")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": meta(md, "llama.feed_forward_length", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": meta(md, "llama.attention.layer_norm_rms_epsilon", path, kind=float, default=1e-5,
                             lo=RMS_EPS[0], hi=RMS_EPS[1]),
        "rope_theta": meta(md, "llama.rope.freq_base", path, kind=float, default=10000.0, lo=ROPE_THETA[0],
                           hi=ROPE_THETA[1], above=True),
        "rope_traditional": True,  # GGUF's q/k rows are permuted for interleaved RoPE (module docstring)
        "max_position_embeddings": meta(md, "llama.context_length", path, default=4096, lo=MIN_CONTEXT,
                                        hi=MAX_CONTEXT),
        "vocab_size": vocab,
    }
    if head_dim != hidden // heads:
        config["head_dim"] = head_dim
    return config, head_dim


def _quantization(h: Header, renames: dict[str, str]) -> tuple[dict | None, str]:
    """config.json's quantization block (the most common bit width as the default, the modules that differ named:
    other bits, or False for an unquantized matrix) and the most common type of the matrices."""
    mods = {renames[t.name[:-len(".weight")]]: t.type for t in h.tensors
            if len(t.shape) == 2 and t.name.endswith(".weight") and t.name[:-len(".weight")] in renames}
    main_type = Counter(mods.values()).most_common(1)[0][0]
    bits = Counter(BITS[ty] for ty in mods.values() if ty in BITS)
    if not bits:
        return None, main_type
    default = bits.most_common(1)[0][0]
    quant: dict = {"group_size": GROUP_SIZE, "bits": default}
    for mod, ty in sorted(mods.items()):
        if ty not in BITS:
            quant[mod] = False
        elif BITS[ty] != default:
            quant[mod] = {"group_size": GROUP_SIZE, "bits": BITS[ty]}
    return quant, main_type


def _rope_scaling(md: dict, path: Path, rope_freqs: TensorInfo | None, base: float, head_dim: int) -> dict | None:
    kind = md.get("llama.rope.scaling.type", "none")
    if rope_freqs is not None:
        return _llama3_scaling(path, rope_freqs, base, head_dim)
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta(md, "llama.rope.scaling.factor", path, kind=float,
                                                 lo=ROPE_FACTOR[0], hi=ROPE_FACTOR[1])}
    raise ConfigError(f"{path}: RoPE scaling {kind!r} is not supported (linear and Llama 3 are)")


def _llama3_scaling(path: Path, t: TensorInfo, base: float, head_dim: int) -> dict:
    """Llama 3.1+ files store RoPE scaling as per-frequency factors (``rope_freqs``), not as parameters. Accept
    them when Llama 3's formula with its published parameters (low 1, high 4, 8192 original context) gives the
    same factors, the factor being the largest; mlx-lm then recomputes them from the parameters."""
    import numpy as np

    if t.type != "F32" or t.shape != (head_dim // 2,):
        raise ConfigError(f"{path}: rope_freqs has shape {list(t.shape)} ({t.type}); expected F32 [{head_dim // 2}]")
    got = np.fromfile(path, dtype="<f4", count=head_dim // 2, offset=t.offset).astype(np.float64)
    if not (np.isfinite(got).all() and ROPE_FACTOR[0] <= got.max() <= ROPE_FACTOR[1]):
        raise ConfigError(f"{path}: its RoPE frequency factors (rope_freqs) range up to {got.max()}, not a Llama 3 "
                          f"scaling factor (finite, {ROPE_FACTOR[0]:g} to {ROPE_FACTOR[1]:g})")
    params = {"factor": float(got.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = params["original_max_position_embeddings"]
    low_wl, high_wl = old / params["low_freq_factor"], old / params["high_freq_factor"]
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (old / wavelen - params["low_freq_factor"]) / (params["high_freq_factor"] - params["low_freq_factor"])
    want = np.where(wavelen < high_wl, 1.0,
                    np.where(wavelen > low_wl, params["factor"],
                             1 / ((1 - smooth) / params["factor"] + smooth)))
    if not np.allclose(got, want, rtol=1e-3, atol=1e-4):
        raise ConfigError(f"{path}: its RoPE frequency factors (rope_freqs) are not Llama 3's scaling; "
                          f"not supported")
    return {"rope_type": "llama3", **{k: f32(v) if isinstance(v, float) else v for k, v in params.items()}}
