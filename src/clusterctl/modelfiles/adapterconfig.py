"""An adapter folder's ``adapter_config.json`` (what ``mlx_lm.lora`` writes), read and checked one way by the
planner (plan/adapter.py) and by every rank (rank/engine/adapter.py).

Read like the other small files: a regular file (never a FIFO or a device), at most ``MAX_CONFIG_BYTES``, a link
only to a file inside the adapter folder, JSON parsed strictly (NaN, Infinity, 1e400 and duplicate keys refused).
Every field mlx-lm's ``load_adapters`` uses is checked here, so a config that would serve something other than
what it says (an infinite scale, a key that names nothing) is refused by name instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from clusterctl.atomic import read_capped, strict_loads
from clusterctl.errors import ClusterctlError, ConfigError

CONFIG = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
KINDS = ("lora", "dora")


@dataclass(frozen=True)
class AdapterConfig:
    fine_tune_type: str  # lora or dora
    num_layers: int  # blocks covered, the last ones (the file's -1: all of them)
    rank: int
    scale: float
    dropout: float  # a training setting: the served model never drops
    keys: tuple[str, ...] | None  # the blocks' modules it targets (their names inside a block); None: every linear

    def lora_parameters(self) -> dict:
        """What mlx-lm's ``linear_to_lora_layers`` reads."""
        out: dict = {"rank": self.rank, "scale": self.scale, "dropout": self.dropout}
        if self.keys is not None:
            out["keys"] = list(self.keys)
        return out


def _raw(folder: Path) -> bytes:
    path = folder / CONFIG
    if path.is_symlink():
        try:
            target = path.resolve()
        except (OSError, RuntimeError):  # a loop
            raise ConfigError(f"{CONFIG} is a link that loops") from None
        if not target.is_relative_to(folder.resolve()):
            raise ConfigError(f"{CONFIG} is a link to {target}, outside the adapter folder")
    try:
        return read_capped(path, limit=MAX_CONFIG_BYTES, what=CONFIG, follow_symlinks=True)
    except ClusterctlError as e:
        if not path.exists() and not path.is_symlink():
            raise ConfigError(f"no {CONFIG} (an mlx_lm.lora output folder has it)") from None
        raise ConfigError(e.message) from None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _keys(params: dict) -> tuple[str, ...] | None:
    keys = params.get("keys")
    if keys is None:
        return None
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError("lora_parameters.keys must be a non-empty list of module names (leave it out for every "
                          "linear)")
    return tuple(keys)


def parse_adapter_config(doc, model_layers: int) -> AdapterConfig:
    """The checked config of a model with ``model_layers`` blocks (ConfigError: one line, naming the field)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{CONFIG} is not a JSON object")
    kind = doc.get("fine_tune_type", "lora")
    if kind not in KINDS:
        raise ConfigError(f"fine_tune_type {str(kind)[:40]!r} is not an adapter (lora, dora); plan a fully "
                          f"fine-tuned model as a model")
    n, params = doc.get("num_layers"), doc.get("lora_parameters")
    if not isinstance(params, dict):
        raise ConfigError(f"{CONFIG} needs num_layers and lora_parameters (rank, scale, dropout)")
    if not _whole(n) or not (n == -1 or 1 <= n <= model_layers):
        if _whole(n) and n > model_layers:
            raise ConfigError(f"num_layers {n} exceeds the model's {model_layers} layers")
        raise ConfigError(f"num_layers {str(n)[:40]} is not a number of blocks (1 to {model_layers}, or -1 for all)")
    rank, scale, dropout = params.get("rank"), params.get("scale"), params.get("dropout")
    if not _whole(rank) or rank < 1:
        raise ConfigError(f"lora_parameters.rank {str(rank)[:40]} is not a positive whole number")
    if not _number(scale) or scale == 0:
        raise ConfigError(f"lora_parameters.scale {str(scale)[:40]} is not a finite, non-zero number")
    if not _number(dropout) or not 0 <= dropout < 1:
        raise ConfigError(f"lora_parameters.dropout {str(dropout)[:40]} is not a number from 0 up to 1")
    return AdapterConfig(fine_tune_type=kind, num_layers=model_layers if n == -1 else n, rank=rank,
                         scale=float(scale), dropout=float(dropout), keys=_keys(params))


def read_adapter_config(folder: Path, model_layers: int) -> AdapterConfig:
    try:
        doc = strict_loads(_raw(folder), source=CONFIG)
    except ClusterctlError as e:
        raise ConfigError(e.message) from None
    return parse_adapter_config(doc, model_layers)
