"""Loading only this rank's layers, in the environment the contract gives it.

Nothing here imports mlx at module level: the environment must be final before mlx is first imported.

Loading: mlx-lm's ``load_model(lazy=True, strict=False)`` maps every tensor lazily; the stage code
(stage.py) replaces the blocks other ranks run with weightless ``Skip`` blocks (mlx-lm's own ``pipeline()``
for the models with state caches whose class has one: modelfiles/archs.py ``split_method``);
``mx.eval(model.parameters())`` then reads only what is left (our blocks plus embedding, final norm and head),
so peak RSS follows this rank's share. The split needs no group yet (group.py ``GroupStandIn``), so we load
BEFORE joining the ring (a slow node's load can't time out a fast node's connect, which gives up after ~31 s)
and join after the launcher's gate.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterctl.errors import ConfigError
from clusterctl.protocol.rankspec import MLX_ENV_DEFAULTS, RankSpec
from clusterctl.rank.engine.group import GroupStandIn
from clusterctl.rank.engine.offload import install, refuse_tied_head
from clusterctl.modelfiles.archs import MLX_PIPELINE, STAGES, cache_kinds, kept_tensors, split_method, text_model
from clusterctl.modelfiles.folder import read_safetensors_header, weight_files


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
        if spec.adapter_path:
            raise ConfigError("a LoRA adapter is served by pipeline ranks only (plan refuses --adapter with "
                              "--parallel tensor)")
        if not callable(getattr(model, "shard", None)):
            raise ConfigError(f"model type {config.get('model_type')!r} cannot shard itself (no shard() in mlx-lm)")
        try:  # the real group comes later (attach_group): the split needs only rank and size
            model.shard(GroupStandIn(spec.rank, spec.world_size))
        except (ValueError, AssertionError) as e:
            raise ConfigError(f"cannot shard the model over {spec.world_size} ranks: {e}") from None
    elif spec.world_size > 1:
        method = split_method(model)  # the decision plan took (modelfiles/archs.py)
        if method == STAGES:
            from clusterctl.rank.engine.stage import split_blocks

            split_blocks(model, spec.rank, spec.world_size, spec.start_layer, spec.end_layer,
                         gather=not spec.overlapped)
        elif method == MLX_PIPELINE:
            try:  # a class may refuse a split (bailing_hybrid: a rank without an MLA layer has no positions)
                inner.pipeline(GroupStandIn(spec.rank, spec.world_size), split=spec.mlx_split)
            except ValueError as e:
                raise ConfigError(f"mlx-lm cannot split the model as planned ({spec.mlx_split}): {e}") from None
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
        from clusterctl.rank.engine.stage import weight_name

        _check_weights_present(path, [weight_name(k) for k, _ in params], config)
    if spec.adapter_path:
        from clusterctl.rank.engine.adapter import apply_adapter

        apply_adapter(model, spec.num_layers, spec.adapter_path, spec.adapter_hash)
        params = tree_flatten(model.parameters())
    if spec.parallel == "tensor":
        for _, v in params:  # one at a time: a shard is cut from its whole tensor, which is then freed
            mx.eval(v)
    else:
        mx.eval([v for _, v in params])
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config
