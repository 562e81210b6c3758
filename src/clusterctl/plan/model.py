"""Model facts from a model folder, without loading weights.

Reads ``config.json`` tolerantly (external file: unknown keys are fine, a nested ``text_config`` is used when the
top level lacks the text model's fields) and the safetensors headers strictly (8-byte little-endian length, a JSON
header, offsets that fit the file), giving bytes per layer, bytes of everything else (embedding, norm, head) and
the KV cache of every layer (``kv_layers``: bytes per token, a sliding window's cap, a state layer's fixed size),
derived from config.json alone the way mlx-lm's model classes build their caches (see ``kv_layers``), and the work
of every layer and of the head (``work``: logical parameters, what one token multiplies through).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from clusterctl.errors import ConfigError, IntegrityError, MissingInput
from clusterctl.plan.configfields import MAX_LAYERS, MAX_SIZE  # noqa: F401  (ggufcheck's bounds are plan's)
from clusterctl.plan.configfields import cfg as _cfg, int_cfg as _int_cfg, positive as _positive
from clusterctl.plan.kvcache import FLOAT_BYTES, kv_dtype_bytes, kv_layers
from clusterctl.protocol.deployment import KvLayer
from clusterctl.modelfiles.folder import DTYPE_BYTES, read_safetensors_header, text_config, weight_files  # noqa: F401
from clusterctl.modelfiles.archs import batching, build_lazy, capability, kept_tensors
from clusterctl.plan.kvquant import class_blocker

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.(weight|scales|biases)$")
_KV_PATH_RE = re.compile(r"(?:^|\.)embed_tokens\.(weight|scales)$|norm[^.]*\.weight$")
_HEAD_RE = re.compile(r"(?:^|\.)lm_head\.weight$")
_EXPERTS_RE = re.compile(r"(?:^|\.)(?:experts|switch_mlp)\.")  # routed experts, one per expert or stacked


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
    # how it splits over ranks (modelfiles/archs.py): None when not looked at (inspect_model(classify=False))
    model_class: str | None = None
    pipeline: str | None = None  # archs.STAGES | archs.MLX_PIPELINE | None (refused: pipeline_reason)
    pipeline_reason: str | None = None
    shardable: bool | None = None  # mlx-lm's class can shard itself (tensor parallel); None: not looked at
    batchable: bool | None = None  # mlx-lm decodes several requests of it together (tried: archs.batching)
    batch_reason: str | None = None
    # why mlx-lm cannot quantize the caches its class makes (plan/kvquant.py); None: it can, or not looked at
    kv_quant_reason: str | None = None
    notes: list[str] = []  # what the plan should tell the operator about the checkpoint
    intermediate_size: int = 0
    kv_layers: list[KvLayer] = Field(default_factory=list)  # one per layer; empty: the uniform legacy estimate
    # logical parameters a token goes through (``work``): one per layer, and the head; empty / 0: not known
    layer_work: list[int] = Field(default_factory=list)
    head_work: int = 0

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """The largest bytes per token of any layer (the whole estimate is ``kv_layers``)."""
        if self.kv_layers:
            return max(k.bytes_per_token for k in self.kv_layers)
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_layer_list(self) -> list[KvLayer]:
        """Every layer's cache: ``kv_layers``, or the same full-attention layer everywhere when not set."""
        if self.kv_layers:
            return self.kv_layers
        return [KvLayer(kind="full", bytes_per_token=2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes)
                ] * self.num_layers

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


# ---- work: what one token costs in each layer and in the head --------------------------------------------------
#
# Measured on a CPU with SmolLM2-135M (4-bit layers, an 8-bit tied embedding used as the head): a stage's time is
# proportional to the logical parameters it multiplies through, whatever their bit width (docs/allocation.md), so
# work is counted in logical parameters, never in bytes.

def work(tensors: dict[str, tuple[str, list[int]]], config: dict, num_layers: int) -> tuple[list[int], int]:
    """(work of every layer, work of the head) in logical parameters: multiply-accumulates per token. ``tensors``:
    name -> (safetensors dtype, shape), every layer's index below ``num_layers``.

    Routed experts (tensors under an ``experts`` or ``switch_mlp`` module: one per expert as checkpoints hold
    them, or stacked as mlx-lm's loader keeps them) count num_experts_per_tok / num_experts of theirs when the
    config gives both (all of them otherwise). The head is ``lm_head.weight``, else the tied embedding used as
    one; looking a token up in the embedding is no work."""
    text = text_config(config)
    quant = _cfg(config, "quantization", "quantization_config")
    dense, routed = [0] * num_layers, [0] * num_layers
    for name in tensors:
        if m := _LAYER_RE.search(name):
            (routed if _EXPERTS_RE.search(name) else dense)[int(m.group(1))] += logical_elements(name, tensors, quant)
    active, experts = _cfg(text, "num_experts_per_tok"), _cfg(text, "num_experts", "num_local_experts",
                                                              "n_routed_experts")
    if not (_positive(active) and _positive(experts)):
        active = experts = 1
    heads = [n for n in tensors if _HEAD_RE.search(n)] or \
            [n for n in tensors if _EMBED_RE.search(n) and n.endswith(".weight")]
    head = max((logical_elements(n, tensors, quant) for n in heads), default=0)
    return [d + r * active // experts for d, r in zip(dense, routed)], head


def logical_elements(name: str, tensors: dict[str, tuple[str, list[int]]], quantization) -> int:
    """One tensor's logical parameters: its elements; a quantized weight (packed U32 beside its ``.scales``)
    unpacked, elements x 32 / bits, and the scales and biases of one none (they are part of it). Bits: the
    module's own entry in config ``quantization`` (mlx-lm's per-module override), else the top-level bits, else
    mlx's default 4."""
    module, _, kind = name.rpartition(".")
    weight = tensors.get(module + ".weight")
    packed = weight is not None and weight[0] == "U32" and module + ".scales" in tensors
    if packed and kind in ("scales", "biases"):
        return 0
    elements = math.prod(tensors[name][1])
    if not (packed and kind == "weight"):
        return elements
    q = quantization if isinstance(quantization, dict) else {}
    own = q.get(module) if isinstance(q.get(module), dict) else {}
    bits = own.get("bits", q.get("bits"))
    return elements * 32 // (bits if _positive(bits) else 4)


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


_OTHER_MODALITY_RE = re.compile(r"(?:^|\.)(?:vision\w*|visual|multi_modal\w*|mm_projector|audio\w*|image\w*)\.")


def dropped_notes(raw: dict[str, tuple[str, list[int]]], kept: dict[str, tuple[str, list[int]]],
                  num_layers: int) -> list[str]:
    """What the plan tells the operator about the parts of the checkpoint mlx-lm's loader drops (the names it
    renames or stacks are not dropped: only layers past the last one and other modalities are named)."""
    gone = set(raw) - set(kept)
    other = {n for n in gone if _OTHER_MODALITY_RE.search(n)}
    beyond = sorted({int(m.group(1)) for n in gone - other
                     if (m := _LAYER_RE.search(n)) and int(m.group(1)) >= num_layers})
    notes = []
    if beyond:
        notes.append(f"the checkpoint's layer(s) {', '.join(map(str, beyond))} beyond num_hidden_layers "
                     f"(e.g. multi-token prediction) are dropped by mlx-lm's loader: not served")
    if other:
        nbytes = sum(math.prod(raw[n][1]) * DTYPE_BYTES[raw[n][0]] for n in other)
        notes.append(f"the checkpoint's {len(other)} tensors of other modalities (vision or audio encoders and "
                     f"projectors, {nbytes / 2**20:.1f} MiB) are dropped by mlx-lm's loader: text only")
    return notes


def _bytes_by_layer(sizes: dict[str, int], num_layers: int, folder: Path) -> tuple[list[int], int, int]:
    """(bytes of each layer, bytes outside the layers, of which the embedding's) from each tensor's size."""
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
    return layer_bytes, shared, embed


def _kv_quant_reason(config: dict) -> str | None:
    try:
        model = build_lazy(config)
    except Exception:  # noqa: BLE001  (capability() reports why the class cannot be built)
        return None
    return class_blocker(model)


def inspect_model(folder: str | os.PathLike, *, classify: bool = True) -> ModelFacts:
    """The facts of a model folder. ``classify``: also find how it splits over ranks and whether mlx-lm batches
    it (modelfiles/archs.py); a launch re-checking a planned deployment skips that. What the ranks hold of the
    checkpoint is found the same way either way (``archs.kept_tensors``, the loader's own ``sanitize``), so the
    plan and the launch's re-check of it apply the same rules."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingInput(f"model folder not found: {folder}")
    config, config_raw = read_config(folder)
    text = text_config(config)
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
    raw_tensors: dict[str, tuple[str, list[int]]] = {}  # name -> (dtype, shape), as the files hold them
    files = weight_files(folder)
    for path in files:
        tensors, raw, _ = read_safetensors_header(path)
        digest.update(f"\0{path.name}\0".encode() + raw)
        raw_tensors.update({name: (t["dtype"], t["shape"]) for name, t in tensors.items()})
    # what the ranks will hold is what mlx-lm's loader keeps (its sanitize: experts stacked, MTP layers and
    # other modalities dropped); the ranks check their weights against the same function (rank/engine/loading.py)
    kept = kept_tensors(config, raw_tensors)
    shapes = kept if kept is not None else raw_tensors
    sizes = {n: math.prod(shape) * DTYPE_BYTES[dtype] for n, (dtype, shape) in shapes.items()}
    dtype_counts: dict[str, int] = {}
    path_dtypes: set[str] = set()  # dtypes on the way to the keys: the embedding (or its scales) and the norms
    for name, (dtype, _) in shapes.items():
        if dtype in FLOAT_BYTES:
            dtype_counts[dtype] = dtype_counts.get(dtype, 0) + sizes[name]
            if _KV_PATH_RE.search(name):
                path_dtypes.add(dtype)
    notes = dropped_notes(raw_tensors, kept, num_layers) if kept is not None else []
    layer_bytes, shared, embed = _bytes_by_layer(sizes, num_layers, folder)
    kv_bytes = kv_dtype_bytes(dtype_counts, path_dtypes, config)
    kv = kv_layers(config, kv_bytes, folder=folder)
    layer_work, head_work = work(shapes, config, num_layers)
    cap = None
    if classify:
        cap = capability(config, num_layers)  # the top-level config: what mlx-lm's loader resolves
        batchable, batch_reason = batching(config)
        kv_quant_reason = _kv_quant_reason(config)
    return ModelFacts(
        model_class=cap.model_class if cap else None, pipeline=cap.pipeline if cap else None,
        pipeline_reason=cap.reason if cap else None, shardable=cap.shard if cap else None,
        batchable=batchable if cap else None, batch_reason=batch_reason if cap else None, notes=notes,
        kv_quant_reason=kv_quant_reason if cap else None,
        intermediate_size=int(_int_cfg(text, folder, "intermediate_size", "ffn_dim", default=0) or 0),
        name=str(_cfg(config, "_name_or_path", default="") or folder.name),
        model_type=str(_cfg(text, "model_type", default="unknown")),
        num_layers=num_layers, hidden_size=hidden, num_heads=heads, num_kv_heads=int(kv_heads),
        head_dim=int(head_dim), vocab_size=int(vocab), tie_word_embeddings=tie,
        quantization=quant if isinstance(quant, dict) else None,
        layer_bytes=layer_bytes, shared_bytes=shared, embed_bytes=embed, kv_dtype_bytes=kv_bytes,
        facts_hash=digest.hexdigest(), files=[p.name for p in files], kv_layers=kv, layer_work=layer_work,
        head_work=head_work,
    )
