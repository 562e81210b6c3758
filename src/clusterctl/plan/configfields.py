"""Fields of an external ``config.json``, read tolerantly (unknown keys are fine) and bounded: the model reader
(model.py) and the KV-cache estimate (kvcache.py) ask for every field through these, so a value at its limits is
refused in one place (tests/test_fuzz_limits.py walks their calls)."""

from __future__ import annotations

from pathlib import Path

from clusterctl.errors import ConfigError

TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
MAX_LAYERS = 1024  # the largest published models have a few hundred; plan builds the class (lazily) with them
MAX_SIZE = 1 << 24  # hidden size, heads, vocabulary: far above any real model, small enough to plan with


def positive(v) -> bool:
    """A count from config.json: an integer above zero (true/false are not numbers)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def int_cfg(config: dict, folder: Path, *keys: str, default=None, minimum: int = 0,
             maximum: int = MAX_SIZE) -> int | None:
    """An integer field of config.json (true/false, strings and lists are errors, not numbers), within bounds
    that keep every later product (per-layer tables, KV bytes) finite and small."""
    v = cfg(config, *keys, default=default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise ConfigError(f"{folder}/config.json: {keys[0]} must be an integer in [{minimum}, {maximum}], "
                          f"not {str(v)[:40]!s}"[:300])
    return v


def cfg(config: dict, *keys: str, default=None):
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default
