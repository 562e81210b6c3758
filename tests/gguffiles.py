"""Test helper: GGUF files of any content, quantized blocks included, written in numpy (no llama.cpp here).

``write_gguf`` writes version 3 files (``Typed`` gives a value an explicit GGUF type); ``quantize``/``dequantize``
implement GGUF's Q4_0, Q4_1 and Q8_0 blocks the way llama.cpp's reference code does; ``tiny_llama`` builds a
random llama in Hugging Face layout and its GGUF form (q/k rows permuted as llama.cpp's converter does), so an
import can be compared with the original. ``count_fields`` lists where a file keeps each of its counts and
lengths, for the fuzzer (tests/gguf/test_fuzz_gguf.py) to lie in.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from clusterctl.gguf.tokenizer import BYTE_SPELLING

GGML = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30}
BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}  # bytes per block of 32 (K: 256)


# ---------------------------------------------------------------------------------------------------- blocks

def quantize(x: np.ndarray, kind: str) -> bytes:
    """Rows of ``x`` (last dimension a multiple of 32) as GGUF blocks of ``kind``."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "F32":
        return x.astype("<f4").tobytes()
    if kind == "F16":
        return x.astype("<f2").tobytes()
    b = x.reshape(-1, 32)
    if kind == "Q8_0":
        d = np.abs(b).max(axis=1) / 127
        inv = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        q = np.round(b * inv[:, None]).astype(np.int8)
        return _blocks([d.astype("<f2")], q.view(np.uint8))
    if kind == "Q4_0":
        idx = np.abs(b).argmax(axis=1)
        mx_ = b[np.arange(len(b)), idx]
        d = mx_ / -8
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.minimum(15, (b * inv[:, None] + 8.5).astype(np.int8)).astype(np.uint8)
        return _blocks([d.astype("<f2")], _nibbles(q))
    if kind == "Q4_1":
        lo, hi = b.min(axis=1), b.max(axis=1)
        d = (hi - lo) / 15
        inv = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        q = np.minimum(15, ((b - lo[:, None]) * inv[:, None] + 0.5).astype(np.int8)).astype(np.uint8)
        return _blocks([d.astype("<f2"), lo.astype("<f2")], _nibbles(q))
    raise ValueError(kind)


def dequantize(raw: bytes, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """llama.cpp's dequantize_row_* for Q4_0/Q4_1/Q8_0 (and plain F16/F32), as float32."""
    if kind in ("F32", "F16"):
        return np.frombuffer(raw, dtype="<f4" if kind == "F32" else "<f2").astype(np.float32).reshape(shape)
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, BLOCK[kind])
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)
    if kind == "Q8_0":
        return (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(shape)
    qs = b[:, 4:] if kind == "Q4_1" else b[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return ((q - 8) * d).reshape(shape)
    m = b[:, 2:4].copy().view("<f2").astype(np.float32)
    return (q * d + m).reshape(shape)


def _nibbles(q: np.ndarray) -> np.ndarray:
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)  # element j low nibble, j+16 high nibble


def _blocks(heads: list[np.ndarray], body: np.ndarray) -> bytes:
    cols = [h.reshape(-1, 1).view(np.uint8) for h in heads] + [body]
    return np.concatenate(cols, axis=1).tobytes()


# ---------------------------------------------------------------------------------------------------- the file

def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


class Typed(NamedTuple):
    """A metadata value written with this GGUF scalar type: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool,
    10 u64, 11 i64, 12 f64."""

    vtype: int
    value: int | float


SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, Typed):
        return v.vtype, struct.pack(SCALAR_FORMATS[v.vtype], v.value)
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return ((4, struct.pack("<I", v)) if 0 <= v < 1 << 32 else (11, struct.pack("<q", v)) if v < 1 << 63
                else (10, struct.pack("<Q", v)))
    if isinstance(v, float):
        small = v != 0 and abs(v) < 1e-45  # f32 would round it to 0
        return (12, struct.pack("<d", v)) if math.isfinite(v) and (abs(v) > 3.4e38 or small) else \
            (6, struct.pack("<f", v))
    if isinstance(v, str):
        return 8, _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            etype, body = 8, b"".join(_string(x) for x in v)
        elif all(isinstance(x, float) for x in v):
            etype, body = 6, np.asarray(v, dtype="<f4").tobytes()
        else:
            etype, body = 5, np.asarray(v, dtype="<i4").tobytes()
        return 9, struct.pack("<IQ", etype, len(v)) + body
    raise TypeError(type(v))


def count_fields(data: bytes) -> list[tuple[int, str, str]]:
    """Where a version-3 file written by ``write_gguf`` keeps its counts and lengths: (byte offset, struct format,
    what), in file order: the header's tensor and key counts; each key's length and value type; a string value's
    length; an array's element type, length and its first string's length; each tensor's name length, dimension
    count, dimensions, type and data offset."""
    out = [(8, "<Q", "header: tensor count"), (16, "<Q", "header: metadata key count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(what: str) -> str:
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        out.append((pos, "<Q", f"length of {what}"))
        pos += 8 + n
        return data[pos - n:pos].decode("utf-8", "replace")

    for _ in range(n_kv):
        key = string("a key")
        out[-1] = (out[-1][0], "<Q", f"length of the key {key}")
        vtype = struct.unpack_from("<I", data, pos)[0]
        out.append((pos, "<I", f"value type of {key}"))
        pos += 4
        if vtype == 8:
            string(f"the text of {key}")
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            out += [(pos, "<I", f"element type of {key}"), (pos + 4, "<Q", f"length of array {key}")]
            pos += 12
            for i in range(count):
                if etype == 8:
                    n = struct.unpack_from("<Q", data, pos)[0]
                    if i == 0:
                        out.append((pos, "<Q", f"length of the first string of {key}"))
                    pos += 8 + n
                else:
                    pos += struct.calcsize(SCALAR_FORMATS[etype])
        else:
            pos += struct.calcsize(SCALAR_FORMATS[vtype])
    for _ in range(n_tensors):
        name = string("a tensor name")
        out[-1] = (out[-1][0], "<Q", f"length of the tensor name {name}")
        ndim = struct.unpack_from("<I", data, pos)[0]
        out.append((pos, "<I", f"dimension count of {name}"))
        pos += 4
        out += [(pos + 8 * i, "<Q", f"dimension {i} of {name}") for i in range(ndim)]
        pos += 8 * ndim
        out += [(pos, "<I", f"type of {name}"), (pos + 4, "<Q", f"data offset of {name}")]
        pos += 12
    return out


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
               *, alignment: int = 32) -> Path:
    """``tensors``: name -> (GGML type name, shape outermost first, raw data)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for k, v in metadata.items():
        vtype, body = _value(v)
        out += [_string(k), struct.pack("<I", vtype), body]
    offset, datas = 0, []
    for name, (kind, shape, data) in tensors.items():
        offset = -(-offset // alignment) * alignment
        dims = tuple(reversed(shape))
        out += [_string(name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML[kind], offset)]
        datas.append((offset, data))
        offset += len(data)
    head = b"".join(out)
    start = -(-len(head) // alignment) * alignment
    body = bytearray(offset)
    for off, data in datas:
        body[off:off + len(data)] = data
    path.write_bytes(head + b"\0" * (start - len(head)) + bytes(body))
    return path


# ---------------------------------------------------------------------------------------------------- a tiny llama

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("Ġ", "t"), ("Ġt", "he"), ("he", "ll"), ("hell", "o")]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: 3 control tokens, the 256 bytes, a few merged tokens."""
    tokens = SPECIALS + [BYTE_SPELLING[b] for b in range(256)] + ["".join(m) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [" ".join(m) for m in MERGES]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half order to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               inter: int = 128, types: dict[str, str] | None = None, tie: bool = False, seed: int = 0,
               arch: str = "llama", extra_meta: dict | None = None, extra_tensors: dict | None = None,
               head_dim: int | None = None, bias: bool = False):
    """Write a random llama GGUF; returns (path, hf_weights, config) where hf_weights are the Hugging Face
    layout weights *as stored* (dequantized), for a reference mlx-lm model with rope_traditional False.

    ``types``: GGUF tensor name prefix ("token_embd", "output", "attn_q", "ffn_down" ...) -> GGML type; F32
    by default (norms and biases always F32). ``bias``: q/k/v/o biases (q/k permuted like their rows)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocab()
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hf: dict[str, np.ndarray] = {}
    tensors: dict = {}

    def put(gguf: str, hf_name: str, arr: np.ndarray, kind_key: str, perm: int | None = None):
        kind = types.get(kind_key, "F32") if arr.ndim == 2 else "F32"
        stored = permute(arr, perm) if perm else arr
        raw = quantize(stored, kind)
        tensors[gguf] = (kind, stored.shape, raw)
        hf[hf_name] = dequantize(raw, kind, stored.shape) if not perm else \
            _unpermute(dequantize(raw, kind, stored.shape), perm)

    put("token_embd.weight", "model.embed_tokens.weight", w(vocab, hidden), "token_embd")
    put("output_norm.weight", "model.norm.weight", 1 + w(hidden) * 0.1, "norm")
    if not tie:
        put("output.weight", "lm_head.weight", w(vocab, hidden), "output")
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", h + "input_layernorm.weight", 1 + w(hidden) * 0.1, "norm")
        put(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + w(hidden) * 0.1, "norm")
        put(b + "attn_q.weight", h + "self_attn.q_proj.weight", w(heads * head_dim, hidden), "attn_q", heads)
        put(b + "attn_k.weight", h + "self_attn.k_proj.weight", w(kv_heads * head_dim, hidden), "attn_k", kv_heads)
        put(b + "attn_v.weight", h + "self_attn.v_proj.weight", w(kv_heads * head_dim, hidden), "attn_v")
        put(b + "attn_output.weight", h + "self_attn.o_proj.weight", w(hidden, heads * head_dim), "attn_output")
        if bias:
            put(b + "attn_q.bias", h + "self_attn.q_proj.bias", w(heads * head_dim), "bias", heads)
            put(b + "attn_k.bias", h + "self_attn.k_proj.bias", w(kv_heads * head_dim), "bias", kv_heads)
            put(b + "attn_v.bias", h + "self_attn.v_proj.bias", w(kv_heads * head_dim), "bias")
            put(b + "attn_output.bias", h + "self_attn.o_proj.bias", w(hidden), "bias")
        put(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", w(inter, hidden), "ffn_gate")
        put(b + "ffn_up.weight", h + "mlp.up_proj.weight", w(inter, hidden), "ffn_up")
        put(b + "ffn_down.weight", h + "mlp.down_proj.weight", w(hidden, inter), "ffn_down")
    tensors.update(extra_tensors or {})
    meta = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": inter,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.vocab_size": vocab,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
        **(extra_meta or {}),
    }
    write_gguf(path, meta, tensors)
    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
              "vocab_size": vocab, "rope_theta": 10000.0, "tie_word_embeddings": tie, "rope_traditional": False,
              "head_dim": head_dim, "attention_bias": bias}
    return path, hf, config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
