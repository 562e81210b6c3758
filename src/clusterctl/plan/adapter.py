"""``plan --adapter PATH``: an ``mlx_lm.lora`` output folder checked against the model, without loading either.

What is checked here (from ``adapter_config.json`` and the safetensors headers, so a bad adapter is refused at
plan time in one line, not at every rank's load): both files present, the config's fields
(modelfiles/adapterconfig.py: a LoRA or DoRA adapter, a full fine-tune being a new model to plan as such;
``num_layers`` within the model; a positive rank, a finite non-zero scale), every key it names a linear of the
blocks it covers, every tensor an adapter leaf (``lora_a``, ``lora_b``, DoRA's ``m``) of a block the adapter
covers, on a linear the model has and its keys name, with that linear's dimensions, and no linear with half its
leaves: nothing planned is left unused, so what is served is what the config says. The ranks check again what
they load (rank/engine/adapter.py), and that the folder is the one planned (its manifest hash).
"""

from __future__ import annotations

import re
from pathlib import Path

from clusterctl.errors import ConfigError, IntegrityError, MissingInput, UsageError
from clusterctl.protocol.deployment import AdapterRef, Deployment, with_identity
from clusterctl.modelfiles.adapterconfig import AdapterConfig, read_adapter_config
from clusterctl.modelfiles.archs import kept_tensors
from clusterctl.modelfiles.folder import read_safetensors_header, weight_files
from clusterctl.plan.model import read_config
from clusterctl.modelfiles.manifest import HashCache, build_manifest

WEIGHTS = "adapters.safetensors"
NODE_FOLDER = ".clusterctl-adapters"  # under a node's model folder: hidden, so the model's manifest ignores it
_BLOCK = re.compile(r"^.*\.layers\.(?P<layer>\d+)\.(?P<key>.+)$")
_LEAF = re.compile(r"^(?P<module>.*\.layers\.(?P<layer>\d+)\..+)\.(?P<leaf>lora_a|lora_b|m)$")


def _model_tensors(model: Path) -> tuple[dict[str, list[int]], int]:
    """name -> shape of what mlx-lm's loader keeps of the checkpoint (its sanitize: experts stacked), and the
    quantization group size."""
    config, _ = read_config(model)
    raw: dict[str, tuple[str, list[int]]] = {}
    for f in weight_files(model):
        header, _, _ = read_safetensors_header(f)
        raw.update({k: (v["dtype"], v["shape"]) for k, v in header.items()})
    kept = kept_tensors(config, raw)
    q = config.get("quantization") if isinstance(config.get("quantization"), dict) else {}
    return {k: shape for k, (_, shape) in (kept if kept is not None else raw).items()}, (q.get("group_size") or 64)


def _linears(tensors: dict[str, list[int]], group: int) -> dict[str, tuple[int, ...]]:
    """module name -> its weight's shape, in logical dimensions ((output, input) for a linear; quantized: the
    input width from its scales), for every module with a weight of 2 or more dimensions (linears, experts)."""
    out = {}
    for name, shape in tensors.items():
        if name.endswith(".weight") and len(shape) >= 2:
            module = name[: -len(".weight")]
            scales = tensors.get(module + ".scales")
            out[module] = (*shape[:-1], scales[-1] * group if scales else shape[-1])
    return out


def _check_keys(folder: Path, cfg: AdapterConfig, linears: dict[str, tuple[int, ...]], num_layers: int) -> None:
    if cfg.keys is None:
        return
    first = num_layers - cfg.num_layers
    have = {m["key"] for name in linears if (m := _BLOCK.match(name)) and int(m["layer"]) >= first}
    for key in cfg.keys:
        if key not in have:
            raise ConfigError(f"--adapter {folder}: lora_parameters.keys names {key[:80]!r}, which no linear of "
                              f"the model's last {cfg.num_layers} blocks is (so nothing would be adapted)")


def _check_tensor(folder: Path, name: str, shape: list[int], cfg: AdapterConfig,
                  linears: dict[str, tuple[int, ...]], num_layers: int) -> str:
    """The module a tensor of the adapter belongs to (ConfigError when it is not one the config adapts)."""
    m = _LEAF.match(name)
    if m is None or (m["leaf"] == "m" and cfg.fine_tune_type != "dora"):
        raise ConfigError(f"--adapter {folder}: {name[:120]} is not a weight of a {cfg.fine_tune_type} layer "
                          f"(lora_a, lora_b{', m' if cfg.fine_tune_type == 'dora' else ''} of a block)")
    layer, module = int(m["layer"]), m["module"].removesuffix(".linear")
    if not num_layers - cfg.num_layers <= layer < num_layers:
        raise ConfigError(f"--adapter {folder}: {name} is for layer {layer}, outside the last {cfg.num_layers} "
                          f"of the model's {num_layers} layers its config names")
    if module not in linears:
        raise ConfigError(f"--adapter {folder}: {name[:120]} is for {module[:120]}, which is not a linear of the "
                          f"model (it would be left unused)")
    key = _BLOCK.match(module)["key"]
    if cfg.keys is not None and key not in cfg.keys:
        raise ConfigError(f"--adapter {folder}: {name[:120]} is for {key}, which lora_parameters.keys does not "
                          f"name (it would be left unused)")
    dims = linears[module]
    if len(dims) == 2:
        outs, ins = dims
        want = {"lora_a": [ins, cfg.rank], "lora_b": [cfg.rank, outs], "m": [outs]}[m["leaf"]]
        if shape != want:
            raise ConfigError(f"--adapter {folder}: {name} has shape {shape}, the model's {module} "
                              f"({ins} in, {outs} out) with rank {cfg.rank} needs {want}")
    return module


def _check_weights(folder: Path, model: Path, num_layers: int, cfg: AdapterConfig) -> None:
    if not (folder / WEIGHTS).is_file():
        raise ConfigError(f"--adapter {folder}: no {WEIGHTS} (an mlx_lm.lora output folder has it)")
    try:
        header, _, _ = read_safetensors_header(folder / WEIGHTS)
    except (IntegrityError, MissingInput) as e:
        raise ConfigError(f"--adapter {folder}: {WEIGHTS}: {e.message}") from None
    if not header:
        raise ConfigError(f"--adapter {folder}: {WEIGHTS} holds no tensors")
    linears = _linears(*_model_tensors(model))
    _check_keys(folder, cfg, linears, num_layers)
    leaves: dict[str, set[str]] = {}
    for name, t in header.items():
        module = _check_tensor(folder, name, t["shape"], cfg, linears, num_layers)
        leaves.setdefault(module, set()).add(name.rsplit(".", 1)[-1])
    need = {"lora_a", "lora_b"} | ({"m"} if cfg.fine_tune_type == "dora" else set())
    for module, have in sorted(leaves.items()):
        if need - have:
            raise ConfigError(f"--adapter {folder}: {WEIGHTS} has no {sorted(need - have)[0]} for {module}")
    for module in sorted(_adapted(cfg, linears, num_layers) - set(leaves)):
        keys = "every linear" if cfg.keys is None else "its keys"
        raise ConfigError(f"--adapter {folder}: {WEIGHTS} has no weights for {module[:120]}, which its config "
                          f"adapts (num_layers {cfg.num_layers}, {keys})")


def _adapted(cfg: AdapterConfig, linears: dict[str, tuple[int, ...]], num_layers: int) -> set[str]:
    """The modules the config turns into LoRA layers (the ranks need each one's weights): in the covered blocks,
    those its keys name, else every plain linear."""
    out = set()
    for module, dims in linears.items():
        m = _BLOCK.match(module)
        if m and num_layers - cfg.num_layers <= int(m["layer"]) < num_layers and (
                m["key"] in cfg.keys if cfg.keys is not None else len(dims) == 2):
            out.add(module)
    return out


def inspect_adapter(folder: Path, model: Path, num_layers: int, nodes: dict[str, tuple[str, bool]]) -> AdapterRef:
    """The adapter at ``folder`` for ``model``; ``nodes``: node -> (its model folder, whether it is this machine).
    A local node reads the coordinator's copy; another node gets its own under its model folder."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise ConfigError(f"--adapter {folder}: no such folder")
    try:
        cfg = read_adapter_config(folder, num_layers)
    except ConfigError as e:
        raise ConfigError(f"--adapter {folder}: {e.message}") from None
    _check_weights(folder, model, num_layers, cfg)
    manifest = build_manifest(folder, cache=HashCache())
    digest = manifest.manifest_hash
    return AdapterRef(source_path=str(folder), manifest_hash=digest, fine_tune_type=cfg.fine_tune_type,
                      num_layers=cfg.num_layers, rank=cfg.rank, path_map=node_paths(str(folder), digest, nodes))


def node_paths(source: str, digest: str, nodes: dict[str, tuple[str, bool]]) -> dict[str, str]:
    """Where each node reads the adapter: a local node the coordinator's copy, another one its own copy in a
    hidden folder under its model folder, named by the adapter's content (two adapters never share one)."""
    return {name: source if local else f"{path.rstrip('/')}/{NODE_FOLDER}/{digest.split(':')[-1][:16]}"
            for name, (path, local) in nodes.items()}


def refuse_tensor(dep: Deployment) -> None:
    if dep.parallel == "tensor" and len(dep.ranks) > 1:
        raise UsageError("--adapter is served by pipeline ranks only: plan with --parallel pipeline "
                         "(tensor parallel ranks do not shard LoRA layers)")


def carried(old: AdapterRef, dep: Deployment) -> Deployment:
    """A replan's ``dep`` serving the adapter ``old`` planned (the same content), at its new nodes' paths."""
    refuse_tensor(dep)
    nodes = {r.node: (dep.path_map[r.node], dep.node(r.node).is_local) for r in dep.ranks}
    ref = old.model_copy(update={"path_map": node_paths(old.source_path, old.manifest_hash, nodes)})
    return with_identity(dep.model_copy(update={"adapter": ref}))
