"""Inside one rank: environment, loading only this rank's layers, joining the group, the control collectives and
the shared request (the batch that every rank decodes identically is in batch.py).

Nothing here imports mlx at module level: the environment must be final before mlx is first imported.

Loading: mlx-lm's ``load_model(lazy=True, strict=False)`` maps every tensor lazily; the stage code
(stage.py) replaces the blocks other ranks run with weightless ``Skip`` blocks (mlx-lm's own ``pipeline()`` for
the models whose caches are not key/value caches, shared/archs.py); ``mx.eval(model.parameters())`` then reads
only what is left (our blocks plus embedding, final norm and head), so peak RSS follows this rank's share. The
split needs no group yet, so we load BEFORE joining the ring (a slow node's load can't time out a fast node's
connect, which gives up after ~31 s) and join after the launcher's gate.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.shared.rankspec import MLX_ENV_DEFAULTS, RankSpec
from clusterctl.atomic import strict_loads
from clusterctl.rank.offload import install, refuse_tied_head
from clusterctl.shared.archs import KV_CACHES, cache_kinds, kept_tensors, text_model
from clusterctl.shared.modelfiles import read_safetensors_header, weight_files

HEADER_WORDS = 8
MAGIC = 0x434C5354  # "CLST": a stale rank of another protocol/job sums to something else
MAX_PAYLOAD = 64 << 20


def rank_environment(spec: RankSpec, environ: dict[str, str]) -> dict[str, str]:
    """The environment this rank runs with: defaults < process env < contract env < what the contract fixes."""
    env = dict(environ)
    for k, v in MLX_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.update(spec.env)
    for k in ("MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_WORLD_SIZE"):
        env.pop(k, None)
    if spec.world_size > 1:
        env["MLX_RANK"] = str(spec.rank)
        if spec.backend == "ring":
            env["MLX_HOSTFILE"] = spec.hostfile
        elif spec.backend == "jaccl":
            env["MLX_IBV_DEVICES"] = spec.hostfile
            if not env.get("MLX_JACCL_COORDINATOR"):
                raise ConfigError("backend jaccl needs MLX_JACCL_COORDINATOR in the contract's env")
    return env


def apply_environment(env: dict[str, str]) -> None:
    for k in list(os.environ):
        if k not in env:
            del os.environ[k]
    os.environ.update(env)


class _Slot:
    """The two things ``PipelineMixin.pipeline`` asks of a group, before the real group exists."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _shape_only_embedding(dims: int, dtype):
    """Stands in for the token embedding on ranks that never use its output (they receive activations)."""
    import mlx.core as mx
    import mlx.nn as nn

    class ShapeOnlyEmbedding(nn.Module):
        def __call__(self, x):
            return mx.zeros((*x.shape, dims), dtype=dtype)

    return ShapeOnlyEmbedding()


def _check_weights_present(model_path: Path, names: list[str], config: dict) -> None:
    """strict=False would leave a missing local tensor at its random init: refuse instead. The names are
    compared with what mlx-lm's loader keeps of the checkpoint (its sanitize: Hugging Face per-expert tensors
    come back stacked, MTP layers dropped), not with the raw names in the files."""

    raw: dict[str, tuple[str, list[int]]] = {}
    for f in weight_files(model_path):
        tensors, _, _ = read_safetensors_header(f)
        raw.update({n: (t["dtype"], t["shape"]) for n, t in tensors.items()})
    kept = kept_tensors(config, raw)
    have = set(kept) if kept is not None else set(raw)
    missing = [n for n in names if n not in have]
    if missing:
        raise ConfigError(f"model at {model_path} lacks {len(missing)} weights this rank needs, e.g. {missing[0]}")


def load_shard(spec: RankSpec):
    """Load this rank's layers only; returns (model, tokenizer, config)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(spec.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"no model at {path} (config.json missing)")
    try:
        model, config = load_model(path, lazy=True, strict=spec.world_size == 1)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(f"cannot load model at {path}: {str(e).splitlines()[0] if str(e) else e}") from None
    inner = text_model(model)
    n = len(inner.layers) if inner is not None else 0
    if n != spec.num_layers:
        raise ConfigError(f"model at {path} has {n} layers, the contract says {spec.num_layers}")
    if spec.world_size > 1 and spec.parallel == "tensor":
        if not callable(getattr(model, "shard", None)):
            raise ConfigError(f"model type {config.get('model_type')!r} cannot shard itself (no shard() in mlx-lm)")
        try:  # the real group comes later (attach_group): the split needs only rank and size
            model.shard(_Slot(spec.rank, spec.world_size))
        except (ValueError, AssertionError) as e:
            raise ConfigError(f"cannot shard the model over {spec.world_size} ranks: {e}") from None
    elif spec.world_size > 1:
        if all(k in KV_CACHES for k in cache_kinds(model)):
            from clusterctl.rank.stage import split_blocks

            split_blocks(model, spec.rank, spec.world_size, spec.start_layer, spec.end_layer,
                         gather=not spec.overlapped)
        elif hasattr(inner, "pipeline"):  # state or linear-attention caches: mlx-lm's own split (shared/archs.py)
            inner.pipeline(_Slot(spec.rank, spec.world_size), split=spec.mlx_split)
            if (inner.start_idx, inner.end_idx) != (spec.start_layer, spec.end_layer):
                raise ConfigError(f"mlx-lm placed rank {spec.rank} at [{inner.start_idx}, {inner.end_idx}), "
                                  f"the contract says [{spec.start_layer}, {spec.end_layer})")
        else:
            raise ConfigError(f"model type {config.get('model_type')!r} cannot be split over ranks "
                              f"(caches: {', '.join(sorted(set(cache_kinds(model))))})")
    if spec.embedding_offload:
        refuse_tied_head(model)
        if spec.rank == spec.world_size - 1:  # the rank that embeds tokens reads rows from SSD
            install(model, path, config)
        else:  # the others only receive activations: they need the embedding's output shape, not its rows
            w = inner.embed_tokens.weight
            inner.embed_tokens = _shape_only_embedding(w.shape[1], w.dtype)
    params = tree_flatten(model.parameters())
    if spec.world_size > 1:
        from clusterctl.rank.stage import weight_name

        _check_weights_present(path, [weight_name(k) for k, _ in params], config)
    if spec.parallel == "tensor":
        for _, v in params:  # one at a time: a shard is cut from its whole tensor, which is then freed
            mx.eval(v)
    else:
        mx.eval([v for _, v in params])
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config


def attach_group(model, group) -> None:
    """Give the sharded layers of a tensor-parallel model the group they sum over (they were made with a
    stand-in that knew only rank and size, before the ring was joined)."""
    for _, m in model.named_modules():
        for name, value in list(vars(m).items()):  # ``group`` on sharded linears, ``sharding_group`` on MoE blocks
            if isinstance(value, _Slot):
                setattr(m, name, group)


def join_group(spec: RankSpec):
    """Join the distributed group (None for a world of one) and check it is the group the contract describes."""
    if spec.world_size == 1:
        return None
    import mlx.core as mx

    if not mx.distributed.is_available(spec.backend):
        raise ConfigError(f"MLX backend {spec.backend!r} is not available on this node")
    group = mx.distributed.init(strict=True, backend=spec.backend)
    if group.rank() != spec.rank or group.size() != spec.world_size:
        raise ConfigError(f"joined as rank {group.rank()} of {group.size()}, "
                          f"expected {spec.rank} of {spec.world_size}")
    return group


def _words(data: bytes, n: int) -> list[int]:
    d = hashlib.sha256(data).digest()
    return [int.from_bytes(d[4 * i:4 * i + 4], "little") & 0x7FFFFFFF for i in range(n)]


def verify_group(group, spec: RankSpec) -> None:
    """All ranks must run the same job with the same split: a stale rank of an old job on a reused port
    would otherwise pair silently and compute garbage."""
    import mlx.core as mx
    import numpy as np

    ident = json.dumps([spec.deployment_id, spec.job_id, spec.world_size, spec.layer_counts, spec.num_layers])
    mine = np.array([spec.rank, *_words(ident.encode(), 3)], dtype=np.int32)
    gathered = np.array(mx.distributed.all_gather(mx.array(mine), group=group), copy=True)
    gathered = gathered.reshape(spec.world_size, -1)
    if sorted(gathered[:, 0].tolist()) != list(range(spec.world_size)):
        raise IntegrityError(f"ring peers report ranks {gathered[:, 0].tolist()}: another job's rank is on this ring")
    if not (gathered[:, 1:] == mine[1:]).all():
        raise IntegrityError("a ring peer belongs to another job or split: refusing to serve")


# ---- control collectives (all ranks call them in the same order) ----

def share_words(group, words: list[int]) -> list[int]:
    """all_sum of a small int32 vector: each rank adds its own votes, rank 0 adds the content."""
    import mlx.core as mx
    import numpy as np

    out = mx.distributed.all_sum(mx.array(np.array(words, dtype=np.int32)), group=group, stream=mx.cpu)
    return np.array(out, copy=True).tolist()


def share_payload(group, data: bytes | None, length: int) -> bytes:
    """Rank 0 contributes ``data`` (length bytes), the others zeros: all_sum gives everyone rank 0's bytes."""
    import mlx.core as mx
    import numpy as np

    if length > MAX_PAYLOAD:
        raise IntegrityError(f"request payload of {length} bytes exceeds {MAX_PAYLOAD}")
    padded = (length + 3) // 4 * 4
    buf = np.zeros(padded, dtype=np.uint8)
    if data is not None:
        buf[:length] = np.frombuffer(data, dtype=np.uint8)
    out = mx.distributed.all_sum(mx.array(buf.view(np.int32)), group=group, stream=mx.cpu)
    return np.array(out, copy=True).view(np.uint8)[:length].tobytes()


def agree_on_tokens(group, spec: RankSpec, tokens: list[int]) -> bool:
    """After a request: did every rank produce the same tokens? (Divergence would otherwise be silent.)"""
    import numpy as np

    words = [0] * (4 * spec.world_size)
    words[4 * spec.rank:4 * spec.rank + 4] = _words(np.array(tokens, dtype=np.int32).tobytes(), 4)
    got = share_words(group, words)
    return all(got[4 * r:4 * r + 4] == got[0:4] for r in range(spec.world_size))


# ---- one request ----

@dataclass
class GenRequest:
    """What rank 0 shares once per request; every rank derives the identical generation from it."""

    id: str
    tokens: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    logit_bias: Optional[dict[str, float]] = None  # token id (as a JSON key) -> additive bias
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: int = -1  # rank 0 reports each token's log-probability and this many alternatives (-1: none)
    # structured output (grammar.py): {"response_format": {...}} or {"lark": "..."} (a forced tool call)
    grammar: Optional[dict] = None
    # rank 0's prompt-cache decision (promptcache.py): reuse the first cache_len tokens of entry cache_from
    cache_from: Optional[int] = None
    cache_len: int = 0
    # rank 0's prompt-cache partition: a hash of the caller's tenant and cache_salt (only the same one reuses)
    partition: Optional[str] = None

    @property
    def took(self) -> tuple[int, int] | None:
        return (self.cache_from, self.cache_len) if self.cache_from is not None else None

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "GenRequest":
        obj = strict_loads(data, source="shared request")
        if not isinstance(obj, dict) or set(obj) - set(cls.__dataclass_fields__):
            raise IntegrityError("shared request has an unexpected shape")
        return cls(**obj)


@dataclass
class GenResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "shutdown" | "error"
    prompt_tokens: int
    error: Optional[str] = None  # "error": why this request failed (its own values, not the rank's state)
    cached_tokens: int = 0  # prompt tokens whose KV the prompt cache gave (not computed again)


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could still start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at = min(i for i, _ in hits)
            self.pending = ""
            return text[:at], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
