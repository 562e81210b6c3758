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

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from clusterctl.errors import ConfigError
from clusterctl.rank.engine.stage import Skip, _Around, weight_name
from clusterctl.modelfiles.adapterconfig import read_adapter_config
from clusterctl.modelfiles.archs import text_model
from clusterctl.modelfiles.manifest import build_manifest

_ADAPTER_LEAVES = ("lora_a", "lora_b", "m")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


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


def _matched(path: Path, model: nn.Module, weights: dict, own: set[int]) -> list[tuple[str, mx.array]]:
    """(parameter, adapter tensor) for every LoRA leaf of this rank's layers; ConfigError when one is missing, of
    the wrong shape, or when a tensor of this rank's blocks matches no LoRA leaf (it would be left unused)."""
    wanted = {weight_name(k): (k, v) for k, v in tree_flatten(model.parameters())
              if k.rsplit(".", 1)[-1] in _ADAPTER_LEAVES}
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
    unused = sorted(n for n in weights if n not in wanted and (m := _LAYER.search(n)) and int(m[1]) in own)
    if unused:
        raise ConfigError(f"adapter at {path}: {unused[0][:120]} matches no LoRA layer of the model (it would be "
                          f"left unused)")
    return pairs


def apply_adapter(model: nn.Module, num_layers: int, adapter_path: str, planned_hash: str | None = None) -> None:
    """Turn this rank's targeted linears into LoRA layers and load their adapter weights (after the split), in
    inference mode (mlx-lm's ``load`` calls ``eval()`` after its adapters: a LoRA layer in training mode applies
    its dropout, and a temperature-0 request gets another answer each time)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    path = Path(adapter_path)
    try:
        cfg = read_adapter_config(path, num_layers)
    except ConfigError as e:
        raise ConfigError(f"adapter at {path}: {e.message}") from None
    weights_file = path / "adapters.safetensors"
    if not weights_file.is_file():
        raise ConfigError(f"cannot read the adapter at {path}: no {weights_file.name}")
    check_planned(path, planned_hash)
    inner = text_model(model)
    blocks = [_own_block(b) for b in inner.layers]  # mlx-lm's pipeline() drops the blocks after its own
    blocks += [nn.Module() for _ in range(num_layers - len(blocks))]
    own = {i for i, b in enumerate(blocks) if b.children()}
    try:
        linear_to_lora_layers(_Blocks(model.model_type, blocks), cfg.num_layers, cfg.lora_parameters(),
                              use_dora=cfg.fine_tune_type == "dora")
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"adapter at {path}: {e}") from None
    pairs = _matched(path, model, mx.load(str(weights_file)), own)
    model.update(tree_unflatten(pairs))
    model.eval()
    mx.eval([w for _, w in pairs])
