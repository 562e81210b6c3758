"""What one rank process is told to do: the payload of a (signed) rank contract.

Layer ranges are in MODEL order. mlx-lm's pipeline is reversed (rank 0 runs the LAST layers, rank N-1 the first,
activations flow N-1 -> ... -> 0), so a rank's [start_layer, end_layer) must equal what that order gives it;
``mlx_split`` converts and the validator refuses a contract whose ranges disagree, because mlx-lm cannot run any
other order.
"""

from __future__ import annotations

import os

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from clusterctl.errors import IntegrityError
from clusterctl.names import Ident, Name
from clusterctl.protocol.deployment import ServingDefaults
from clusterctl.atomic import read_json

# Set by the rank itself from the contract; extra env must not override them.
RESERVED_ENV = frozenset({"MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_WORLD_SIZE"})


def layer_range(layer_counts: list[int], rank: int) -> tuple[int, int]:
    """[start, end) in model order of ``rank`` under mlx-lm's reversed pipeline order."""
    start = sum(layer_counts[rank + 1:])
    return start, start + layer_counts[rank]


class RankSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    deployment_id: Ident
    job_id: Ident
    nonce: str = Field(min_length=1, max_length=200)
    node: Name
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1, le=1024)
    backend: Literal["ring", "jaccl", "mpi"] = "ring"
    parallel: Literal["pipeline", "tensor"] = "pipeline"  # tensor: every rank holds 1/N of every layer
    model_path: str
    # a LoRA adapter folder (mlx_lm.lora's output) on this node, and its planned manifest hash (None: none)
    adapter_path: Optional[str] = None
    adapter_hash: Optional[str] = None
    # the KV cache stored quantized once a sequence holds quantized_kv_start tokens (None: full precision)
    kv_bits: Optional[Literal[4, 8]] = None
    kv_group_size: Literal[32, 64, 128] = 64
    quantized_kv_start: int = Field(default=5000, ge=0)
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)
    # every rank's layer count, in rank order: optional, and not in launch's contracts (a list of N per rank made
    # launch O(N^2)); a rank needs only its own range, which must be one mlx-lm's order can give (below)
    layer_counts: Optional[list[int]] = None
    num_layers: int = Field(ge=1)
    hostfile: Optional[str] = None
    http_host: str = "127.0.0.1"
    http_port: Optional[int] = Field(default=None, ge=0, le=65535)
    api_key: Optional[SecretStr] = None
    # rank 0: more callers, each with its own key and its own prompt-cache partition (tenant name -> key); the
    # api_key above is the tenant "default"
    api_keys: dict[Name, SecretStr] = Field(default_factory=dict, max_length=1024)
    # rank 0: more names clients may give as `model` (besides the model folder's name and "default_model")
    model_aliases: list[Name] = Field(default_factory=list, max_length=64)
    # rank 0: the model's own name as clients give it (a deployment planned by its hub name: the repository id,
    # as mlx_lm.server names it); None: the model folder's name
    served_name: Optional[str] = Field(default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_./-]+$")
    # rank 0: browser origins allowed to call the API (CORS; "*": any); empty: no CORS headers at all
    cors_origins: list[str] = Field(default_factory=list, max_length=64)
    seed: int = Field(default=0, ge=0, lt=2**31)
    runtime_dir: str
    marker_path: str
    gate_path: str
    lease_path: Optional[str] = None
    lease_seconds: float = Field(default=30.0, gt=0, le=3600)
    embedding_offload: bool = False
    # when a request gives no max_tokens and serving has none: this many (None: until its context is full)
    max_tokens_default: Optional[int] = Field(default=None, ge=1, le=1 << 26)
    # rank 0: the operator's defaults for what a request leaves out, chat template override and arguments
    serving: ServingDefaults = Field(default_factory=ServingDefaults)
    # serving: requests decoded together (the plan's batch slots) and requests waiting beyond them (then 429)
    max_batch: int = Field(default=8, ge=1, le=1024)
    max_queue: int = Field(default=64, ge=0, le=1 << 16)
    http_timeout_s: float = Field(default=30.0, gt=0, le=3600)  # rank 0: a client idle this long is dropped
    env: dict[str, str] = Field(default_factory=dict)
    # how long a ring exchange that takes milliseconds when healthy may hang before the rank gives up
    control_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    join_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    # the peer-loss ladder (rank/peerprobe.py): probe every interval, act after tolerance misses, grace to return
    probe_interval_s: float = Field(default=1.0, gt=0, le=60)
    probe_tolerance: int = Field(default=2, ge=1, le=100)
    abort_grace_s: float = Field(default=5.0, ge=0, le=3600)
    # off only to measure what the checks cost (bench/cancel.py); launch always turns them on
    peer_probes: bool = True
    # the nice value of the rank's compute threads, below its HTTP and control threads (rank/priority.py)
    compute_nice: int = Field(default=10, ge=0, le=19)
    cancel_checks: bool = True
    # pipeline decode: "overlap" keeps one micro-batch per stage in flight (rank/engine/overlap.py), "lockstep"
    # runs every step on every rank together; overlap applies to a split pipeline of 2+ ranks, else lockstep
    schedule: Literal["lockstep", "overlap"] = "overlap"
    # the prompt cache (rank/engine/promptcache.py): tokens of KV every rank keeps for reuse (0: off)
    prompt_cache_tokens: int = Field(default=0, ge=0, le=1 << 26)
    # rank 0: the most tokens (prompt + completion) one request may hold: the plan's per-slot context, for which
    # every rank reserved KV (None: the model's own max_position_embeddings, a contract from before)
    context_tokens: Optional[int] = Field(default=None, ge=2, le=1 << 26)

    @model_validator(mode="after")
    def _consistent(self) -> "RankSpec":
        if self.schema_version != 1:
            raise ValueError(f"schema_version {self.schema_version} is not supported (this rank reads 1)")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        counts = self.layer_counts
        if counts is not None and len(counts) != self.world_size:
            raise ValueError(f"layer_counts has {len(counts)} entries for world_size {self.world_size}")
        if self.parallel == "tensor":
            if any(c != self.num_layers for c in counts or ()) or \
                    (self.start_layer, self.end_layer) != (0, self.num_layers):
                raise ValueError(f"a tensor-parallel rank runs every layer: layer_counts {counts} and "
                                 f"[{self.start_layer}, {self.end_layer}) must all be {self.num_layers}")
            return self._common()
        if counts is None:
            return self._own_range()._common()
        if any(c <= 0 for c in self.layer_counts) or sum(self.layer_counts) != self.num_layers:
            raise ValueError(f"layer_counts {self.layer_counts} must be positive and sum to {self.num_layers}")
        want = layer_range(self.layer_counts, self.rank)
        if (self.start_layer, self.end_layer) != want:
            raise ValueError(
                f"rank {self.rank} is given layers [{self.start_layer}, {self.end_layer}) but mlx-lm's pipeline "
                f"order (rank 0 runs the last layers) gives it [{want[0]}, {want[1]}) for {self.layer_counts}")
        return self._common()

    def _own_range(self) -> "RankSpec":
        """Without the whole split: this rank's range is one mlx-lm's order can give it (rank 0 runs the last
        layers, rank N-1 the first, every rank at least one), so the ranks after it hold [0, start) and the ones
        before it [end, num_layers). That the ranks' ranges tile the model is the signed deployment's (each
        contract is checked against its row of it)."""
        r, w, s, e, n = self.rank, self.world_size, self.start_layer, self.end_layer, self.num_layers
        later, earlier = w - 1 - r, r  # ranks running the layers before s, and after e
        if not (s < e <= n and s >= later and n - e >= earlier and (later or s == 0) and (earlier or e == n)):
            raise ValueError(f"rank {r} of {w} is given layers [{s}, {e}) of {n}, which mlx-lm's pipeline order "
                             f"(rank 0 runs the last layers, every rank at least one) cannot give it")
        return self

    def _common(self) -> "RankSpec":
        if self.world_size == 1 and self.hostfile is not None:
            raise ValueError("a world of one takes no hostfile")
        if self.world_size > 1 and self.backend in ("ring", "jaccl") and not self.hostfile:
            raise ValueError(f"backend {self.backend} needs a hostfile")
        if self.rank == 0 and self.http_port is None:
            raise ValueError("rank 0 needs http_port")
        bad = sorted(set(self.env) & RESERVED_ENV)
        if bad:
            raise ValueError(f"env may not set {', '.join(bad)} (the rank sets them from the contract)")
        for k in self.env:
            if not k or "=" in k or "\0" in k or "\0" in self.env[k]:
                raise ValueError(f"bad environment variable name {k!r}")
        return self

    @property
    def mlx_split(self) -> list[int]:
        """The ``split`` argument of mlx-lm's ``pipeline(group, split)``: layer counts in rank order. Without
        ``layer_counts``, one that places this rank exactly (pipeline() reads only this rank's entry and the sum
        of the later ranks'; every entry must be positive and all sum to the layers): one layer to each other
        rank, the rest of each side to the rank next to this one's neighbours' ends."""
        if self.layer_counts is not None:
            return list(self.layer_counts)
        r, w = self.rank, self.world_size
        earlier = [1] * r  # ranks 0 .. r-1 run [end_layer, num_layers)
        if earlier:
            earlier[0] += self.num_layers - self.end_layer - r
        later = [1] * (w - 1 - r)  # ranks r+1 .. w-1 run [0, start_layer)
        if later:
            later[-1] += self.start_layer - len(later)
        return [*earlier, self.end_layer - self.start_layer, *later]

    @property
    def overlapped(self) -> bool:
        """Does this rank run the overlapped schedule? (a pipeline of 2 or more ranks asked for it)"""
        return self.schedule == "overlap" and self.world_size > 1 and self.parallel == "pipeline"

    @property
    def probes_on(self) -> bool:
        """Do the ranks answer on the peer-probe port (UDP at each ring address): probes, join order, wake-ups?"""
        return self.world_size > 1 and self.backend == "ring" and bool(self.hostfile) and self.peer_probes

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None

    def tenant_keys(self) -> dict[str, str]:
        """Every key rank 0 accepts, by tenant name ("default": api_key)."""
        keys = {name: k.get_secret_value() for name, k in self.api_keys.items()}
        if self.api_key is not None:
            keys.setdefault("default", self.api_key.get_secret_value())
        return keys


def parse_rank_spec(obj: object, *, source: str = "rank spec") -> RankSpec:
    """Validate a decoded spec; errors name the field, never echo values (the api_key could be among them)."""
    try:
        return RankSpec.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "spec"
        raise IntegrityError(f"{source} is invalid: {where}: {first.get('msg', 'invalid')}") from None


def load_unsigned_spec(path: str | Path) -> RankSpec:
    """Read an UNSIGNED spec file (tests and development only; the rank gates this behind an env var)."""

    return parse_rank_spec(read_json(path, limit=1 << 20, what="rank spec"), source=f"rank spec {path}")


# What the launcher reads from its own environment and writes into every rank's contract (the ranks apply it).
MLX_ENV_DEFAULTS = {  # defaults that yield to the operator's values (process environment, then the contract's env)
    "MLX_MAX_OPS_PER_BUFFER": "16",
    "MLX_MAX_MB_PER_BUFFER": "512",
    "JACCL_PROGRESS_TIMEOUT_MS": "30000",
    "JACCL_TIMEOUT_ACTION": "teardown-exit",
}
DEFAULT_ABORT_GRACE = 5.0  # seconds a rank that lost a peer waits for the others before it aborts (rank/peerprobe.py)
ENV_ABORT_GRACE = "CLUSTERCTL_PEER_ABORT_GRACE"
DEFAULT_COMPUTE_NICE = 10  # how far the compute threads yield to the control plane (rank/priority.py)
ENV_COMPUTE_NICE = "CLUSTERCTL_RANK_COMPUTE_NICE"


def _bounded_from_env(environ, name: str, kind, lo, hi, default):
    """``kind(environ[name])`` when set, parseable and within [lo, hi]; else ``default``."""
    raw = (os.environ if environ is None else environ).get(name)
    try:
        v = kind(raw) if raw is not None else default
    except ValueError:
        return default
    return v if lo <= v <= hi else default


def abort_grace_from_env(environ=None) -> float:
    """``CLUSTERCTL_PEER_ABORT_GRACE`` (0 to 3600 s), else the default."""
    return _bounded_from_env(environ, ENV_ABORT_GRACE, float, 0, 3600, DEFAULT_ABORT_GRACE)


def compute_nice_from_env(environ=None) -> int:
    """``CLUSTERCTL_RANK_COMPUTE_NICE`` (0 to 19; 0 turns it off), else the default."""
    return _bounded_from_env(environ, ENV_COMPUTE_NICE, int, 0, 19, DEFAULT_COMPUTE_NICE)
