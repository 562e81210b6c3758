"""A LoRA adapter (an ``mlx_lm.lora`` output folder) on this rank's layers only.

mlx-lm's ``load_adapters`` swaps the targeted linears of the model's last ``num_layers`` blocks for LoRA layers
and loads ``adapters.safetensors`` into them. A pipeline rank holds some blocks only (the others are ``Skip``,
the first and last of its own wrapped by ``Recv``/``Send``), so the swap runs on a stand-in whose ``layers`` is
the WHOLE model's list of blocks in model order (a block this rank does not run is an empty module): "the last
``num_layers``" then means the same blocks as in one process, and the targeted keys are the block's own names
(``self_attn.q_proj``, not ``block.self_attn.q_proj``). The adapter's tensors of the other ranks' blocks are left
unread. Not fused: the LoRA layers compute exactly what one ``mlx_lm.load(model, adapter_path=...)`` process
computes (docs/architectures.md, adapters).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from clusterctl.errors import ConfigError
from clusterctl.rank.engine.stage import Skip, _Around, weight_name
from clusterctl.modelfiles.archs import text_model
from clusterctl.modelfiles.manifest import build_manifest

_ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


class _Blocks:
    """What ``linear_to_lora_layers`` reads of a model: its type and its blocks (no module of its own)."""

    def __init__(self, model_type: str, layers: list[nn.Module]):
        self.model_type = model_type
        self.layers = layers

    def named_modules(self):
        return []


def _own_block(block: nn.Module | None) -> nn.Module:
    """The block itself, inside stage.py's wrappers; another rank's (a ``Skip``, or the ``None`` mlx-lm's own
    ``pipeline()`` leaves) is an empty module."""
    while isinstance(block, _Around):
        block = block.block
    return nn.Module() if block is None or isinstance(block, Skip) else block


def check_planned(adapter_path: Path, planned_hash: str | None) -> None:
    """The adapter folder is the one the deployment was planned with (its manifest hash)."""
    if planned_hash is None:
        return
    have = build_manifest(adapter_path).manifest_hash
    if have != planned_hash:
        raise ConfigError(f"the adapter at {adapter_path} is not the one planned (manifest {have}, planned "
                          f"{planned_hash}): run clusterctl sync, or plan again")


def apply_adapter(model: nn.Module, num_layers: int, adapter_path: str, planned_hash: str | None = None) -> None:
    """Turn this rank's targeted linears into LoRA layers and load their adapter weights (after the split)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    path = Path(adapter_path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        weights_file = path / "adapters.safetensors"
        if not weights_file.is_file():
            raise FileNotFoundError(weights_file)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the adapter at {path}: {e}") from None
    check_planned(path, planned_hash)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise ConfigError(f"adapter at {path}: fine_tune_type {kind!r} is not served (lora, dora)")
    inner = text_model(model)
    blocks = [_own_block(b) for b in inner.layers]  # mlx-lm's pipeline() drops the blocks after its own
    blocks += [nn.Module() for _ in range(num_layers - len(blocks))]
    try:
        linear_to_lora_layers(_Blocks(model.model_type, blocks), int(config["num_layers"]),
                              config["lora_parameters"], use_dora=kind == "dora")
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"adapter at {path}: {e}") from None
    wanted = {weight_name(k): (k, v) for k, v in tree_flatten(model.parameters())
              if k.rsplit(".", 1)[-1] in _ADAPTER_LEAVES}
    weights = mx.load(str(weights_file))
    pairs, missing = [], []
    for name, (param, current) in wanted.items():
        w = weights.get(name)
        if w is None:
            missing.append(name)
        elif w.shape != current.shape:
            raise ConfigError(f"adapter at {path}: {name} has shape {tuple(w.shape)}, the model's LoRA layer "
                              f"wants {tuple(current.shape)}")
        else:
            pairs.append((param, w))
    if missing:
        raise ConfigError(f"adapter at {path} lacks {len(missing)} weights this rank's layers need, e.g. {missing[0]}")
    model.update(tree_unflatten(pairs))
    mx.eval([w for _, w in pairs])
