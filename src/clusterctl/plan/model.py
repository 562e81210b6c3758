"""Model facts from a model folder, without loading weights.

Reads ``config.json`` tolerantly (external file: unknown keys are fine, a nested ``text_config`` is used when the
top level lacks the text model's fields) and the safetensors headers strictly (8-byte little-endian length, a JSON
header, offsets that fit the file), giving bytes per layer, bytes of everything else (embedding, norm, head) and
KV-cache bytes per token.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from clusterctl.atomic import read_capped, strict_loads
from clusterctl.errors import ConfigError, IntegrityError, MissingInput

MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.(weight|scales|biases)$")


class TensorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    file: str


class ModelFacts(BaseModel):
    """What planning needs to know about a model; derived only from config.json and safetensors headers."""

    model_config = ConfigDict(extra="forbid")

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    quantization: dict | None = None
    layer_bytes: list[int]
    shared_bytes: int  # embedding, final norm, lm_head: every pipeline rank keeps them
    embed_bytes: int = 0  # the token embedding alone (part of shared_bytes): what embedding offload saves
    kv_dtype_bytes: int
    facts_hash: str  # sha256 over config.json and every safetensors header: changes when the weights change
    files: list[str]
    # how it splits over ranks (plan/archs.py): None when not looked at (inspect_model(classify=False))
    model_class: str | None = None
    pipeline: str | None = None  # archs.STAGES | archs.MLX_PIPELINE | None (refused: pipeline_reason)
    pipeline_reason: str | None = None
    shardable: bool | None = None  # mlx-lm's class can shard itself (tensor parallel); None: not looked at
    batchable: bool | None = None  # mlx-lm decodes several requests of it together (tried: archs.batching)
    batch_reason: str | None = None
    notes: list[str] = []  # what the plan should tell the operator about the checkpoint
    intermediate_size: int = 0

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.shared_bytes

    @property
    def pipeline_capable(self) -> bool:
        return self.pipeline is not None or self.model_class is None

    def tensor_blockers(self, world: int) -> list[str]:
        """Why this model cannot be sharded evenly over ``world`` ranks (tensor parallel); empty when it can."""
        out = []
        if self.shardable is False:
            out.append(f"mlx-lm's {self.model_class or self.model_type} cannot shard itself (no shard())")
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                        ("intermediate size", self.intermediate_size)):
            if n and n % world:
                out.append(f"{n} {what} do not divide by {world} ranks")
        gs = (self.quantization or {}).get("group_size") if isinstance(self.quantization, dict) else None
        if isinstance(gs, int) and gs > 0 and not out:
            for what, n in (("attention output", self.num_heads * self.head_dim),
                            ("MLP down projection", self.intermediate_size)):
                if n and (n // world) % gs:
                    out.append(f"the {what}'s {n // world} inputs per rank are not a multiple of the "
                               f"quantization group size {gs}")
        return out


def read_safetensors_header(path: Path) -> tuple[dict, bytes, int]:
    """Return (tensors, raw header bytes, data start offset). Raises IntegrityError on any inconsistency."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise IntegrityError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise IntegrityError(f"{path}: corrupt safetensors header (header length {n})")
            if 8 + n > size:
                raise IntegrityError(f"{path}: truncated safetensors file (header needs {n} bytes, file has {size - 8})")
            raw = f.read(n)
    except FileNotFoundError:
        raise MissingInput(f"weights file not found: {path}") from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read: {e.strerror or e}") from None
    header = strict_loads(raw.rstrip(b" "), source=f"safetensors header of {path}")
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: corrupt safetensors header (not an object)")
    data_len = size - 8 - n
    tensors: dict[str, dict] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        def ints(v) -> bool:
            return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not ints(info.get("shape")) \
                or not ints(info.get("data_offsets")) or len(info["data_offsets"]) != 2:
            raise IntegrityError(f"{path}: corrupt safetensors header entry for {name!r}")
        dtype, shape = info["dtype"], list(info["shape"])
        begin, end = info["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise IntegrityError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        count = 1
        for d in shape:
            if d < 0:
                raise IntegrityError(f"{path}: tensor {name!r} has a negative dimension")
            count *= d
        if not 0 <= begin <= end or end - begin != count * DTYPE_BYTES[dtype]:
            raise IntegrityError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match {dtype}{shape}")
        if end > data_len:
            raise IntegrityError(f"{path}: truncated safetensors file (tensor {name!r} ends past the end of the file)")
        tensors[name] = {"dtype": dtype, "shape": shape, "begin": begin, "end": end}
    return tensors, raw, 8 + n


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            data = strict_loads(read_capped(index, limit=64 << 20, what="weight index"), source=str(index))
            weight_map = data["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError):
            raise IntegrityError(f"{index}: no weight_map") from None
        for n in names:
            if not isinstance(n, str) or "/" in n or n.startswith("."):
                raise IntegrityError(f"{index}: bad file name {n!r} in weight_map")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingInput(f"{folder}: no *.safetensors files and no model.safetensors.index.json")
    return files


MAX_LAYERS = 1 << 16  # the largest published models have a few hundred; beyond this a config is nonsense
MAX_SIZE = 1 << 24  # hidden size, heads, vocabulary: far above any real model, small enough to plan with


def _int_cfg(config: dict, folder: Path, *keys: str, default=None, minimum: int = 0,
             maximum: int = MAX_SIZE) -> int | None:
    """An integer field of config.json (true/false, strings and lists are errors, not numbers), within bounds
    that keep every later product (per-layer tables, KV bytes) finite and small."""
    v = _cfg(config, *keys, default=default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise ConfigError(f"{folder}/config.json: {keys[0]} must be an integer in [{minimum}, {maximum}], "
                          f"not {str(v)[:40]!s}"[:300])
    return v


def _cfg(config: dict, *keys: str, default=None):
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


def read_config(folder: Path) -> tuple[dict, bytes]:
    path = folder / "config.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MissingInput(f"{folder}: no config.json (is this a model folder?)") from None
    except OSError as e:
        raise MissingInput(f"cannot read {path}: {e.strerror or e}") from None
    try:
        config = json.loads(raw)  # external file: tolerant
    except (ValueError, RecursionError):
        raise IntegrityError(f"{path}: not valid JSON") from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{path}: not a JSON object")
    return config, raw


def inspect_model(folder: str | os.PathLike, *, classify: bool = True) -> ModelFacts:
    """The facts of a model folder. ``classify``: also build mlx-lm's class for it (lazily: no weights) to find
    how it splits over ranks (plan/archs.py); a launch re-checking a planned deployment skips that."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingInput(f"model folder not found: {folder}")
    config, config_raw = read_config(folder)
    text = config
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        text = {**config, **config["text_config"]}
    num_layers = _int_cfg(text, folder, "num_hidden_layers", "n_layers", "num_layers", minimum=1,
                         maximum=MAX_LAYERS)
    hidden = _int_cfg(text, folder, "hidden_size", "d_model", "dim", minimum=1)
    heads = _int_cfg(text, folder, "num_attention_heads", "n_heads", minimum=1)
    if num_layers is None:
        raise ConfigError(f"{folder}/config.json: num_hidden_layers missing")
    if hidden is None or heads is None:
        raise ConfigError(f"{folder}/config.json: hidden_size / num_attention_heads missing")
    kv_heads = _int_cfg(text, folder, "num_key_value_heads", "n_kv_heads", default=heads, minimum=1)
    head_dim = _int_cfg(text, folder, "head_dim", default=hidden // heads, minimum=1)
    vocab = _int_cfg(text, folder, "vocab_size", default=0)
    tie = bool(_cfg(text, "tie_word_embeddings", default=False))
    quant = _cfg(config, "quantization", "quantization_config")

    digest = hashlib.sha256()
    digest.update(b"config.json\0" + config_raw)
    raw_tensors: dict[str, tuple[str, list[int], int]] = {}  # name -> (dtype, shape, bytes), as the files hold them
    dtype_counts: dict[str, int] = {}
    files = _weight_files(folder)
    for path in files:
        tensors, raw, _ = read_safetensors_header(path)
        digest.update(f"\0{path.name}\0".encode() + raw)
        for name, t in tensors.items():
            nbytes = t["end"] - t["begin"]
            raw_tensors[name] = (t["dtype"], t["shape"], nbytes)
            if t["dtype"] in ("F32", "F16", "BF16"):
                dtype_counts[t["dtype"]] = dtype_counts.get(t["dtype"], 0) + nbytes
    # what the ranks will hold is what mlx-lm's loader keeps (its sanitize: experts stacked, MTP layers dropped)
    kept = None
    if classify:
        from clusterctl.plan.archs import kept_tensors

        kept = kept_tensors(config, {n: (d, s) for n, (d, s, _) in raw_tensors.items()})
    sizes = kept if kept is not None else {n: b for n, (_, _, b) in raw_tensors.items()}
    notes = []
    if kept is not None:
        beyond = sorted({int(m.group(1)) for n in set(raw_tensors) - set(kept) if (m := _LAYER_RE.search(n))
                         and int(m.group(1)) >= num_layers})
        if beyond:
            notes.append(f"the checkpoint's layer(s) {', '.join(map(str, beyond))} beyond num_hidden_layers "
                         f"(e.g. multi-token prediction) are dropped by mlx-lm's loader: not served")
    layer_bytes = [0] * num_layers
    shared = 0
    embed = 0
    for name, nbytes in sizes.items():
        m = _LAYER_RE.search(name)
        if m:
            i = int(m.group(1))
            if i >= num_layers:
                raise IntegrityError(f"{folder}: tensor {name!r} is for layer {i}, but config.json says "
                                     f"{num_layers} layers")
            layer_bytes[i] += nbytes
        else:
            shared += nbytes
            if _EMBED_RE.search(name):
                embed += nbytes
    if not any(layer_bytes):
        raise IntegrityError(f"{folder}: no layer tensors found in the safetensors headers")
    kv_bytes = TORCH_DTYPE_BYTES.get(str(_cfg(text, "torch_dtype", "dtype", default="")), 0)
    if not kv_bytes:
        main = max(dtype_counts, key=dtype_counts.get) if dtype_counts else "F16"
        kv_bytes = DTYPE_BYTES[main]
    cap = None
    if classify:
        from clusterctl.plan.archs import capability

        cap = capability(config, num_layers)  # the top-level config: what mlx-lm's loader resolves
        from clusterctl.plan.archs import batching

        batchable, batch_reason = batching(config)
    return ModelFacts(
        model_class=cap.model_class if cap else None, pipeline=cap.pipeline if cap else None,
        pipeline_reason=cap.reason if cap else None, shardable=cap.shard if cap else None,
        batchable=batchable if cap else None, batch_reason=batch_reason if cap else None, notes=notes,
        intermediate_size=int(_int_cfg(text, folder, "intermediate_size", "ffn_dim", default=0) or 0),
        name=str(_cfg(config, "_name_or_path", default="") or folder.name),
        model_type=str(_cfg(text, "model_type", default="unknown")),
        num_layers=num_layers, hidden_size=hidden, num_heads=heads, num_kv_heads=int(kv_heads),
        head_dim=int(head_dim), vocab_size=int(vocab), tie_word_embeddings=tie,
        quantization=quant if isinstance(quant, dict) else None,
        layer_bytes=layer_bytes, shared_bytes=shared, embed_bytes=embed, kv_dtype_bytes=kv_bytes,
        facts_hash=digest.hexdigest(), files=[p.name for p in files],
    )
