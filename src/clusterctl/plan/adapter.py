"""``plan --adapter PATH``: an ``mlx_lm.lora`` output folder checked against the model, without loading either.

What is checked here (from ``adapter_config.json`` and the safetensors headers, so a bad adapter is refused at
plan time in one line, not at every rank's load): both files present, a LoRA or DoRA adapter (a full fine-tune is
a new model: plan that folder instead), ``num_layers`` within the model, every tensor an adapter leaf
(``lora_a``, ``lora_b``, DoRA's ``m``) of a block the adapter covers, on a linear the model has, with that
linear's dimensions. The ranks check again what they load (rank/engine/adapter.py), and that the folder is the one
planned (its manifest hash).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from clusterctl.errors import ConfigError, IntegrityError, MissingInput, UsageError
from clusterctl.protocol.deployment import AdapterRef, Deployment, with_identity
from clusterctl.modelfiles.folder import read_safetensors_header, weight_files
from clusterctl.modelfiles.manifest import HashCache, build_manifest

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
NODE_FOLDER = ".clusterctl-adapters"  # under a node's model folder: hidden, so the model's manifest ignores it
_LEAF = re.compile(r"^(?P<module>.*\.layers\.(?P<layer>\d+)\..+)\.(?P<leaf>lora_a|lora_b|m)$")


def _config(folder: Path, num_layers: int) -> tuple[str, int, int]:
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--adapter {folder}: no {CONFIG} (an mlx_lm.lora output folder has it)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--adapter {folder}: cannot read {CONFIG}: {e}") from None
    kind = cfg.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise ConfigError(f"--adapter {folder}: fine_tune_type {kind!r} is not an adapter (lora, dora); plan a "
                         f"fully fine-tuned model as a model")
    params = cfg.get("lora_parameters")
    n = cfg.get("num_layers")
    if not isinstance(n, int) or not isinstance(params, dict) or not isinstance(params.get("rank"), int) \
            or not isinstance(params.get("scale"), (int, float)):
        raise ConfigError(f"--adapter {folder}: {CONFIG} needs num_layers and lora_parameters.rank and .scale")
    if n > num_layers:
        raise ConfigError(f"--adapter {folder}: num_layers {n} exceeds the model's {num_layers} layers")
    return kind, (num_layers if n < 0 else n), params["rank"]


def _linear_dims(model: Path, config: dict) -> dict[str, tuple[int, int]]:
    """module name -> (input dims, output dims) of each linear in the checkpoint (quantized: from its scales)."""
    tensors: dict[str, list[int]] = {}
    for f in weight_files(model):
        header, _, _ = read_safetensors_header(f)
        tensors.update({k: v["shape"] for k, v in header.items()})
    group = ((config.get("quantization") or {}).get("group_size") or 64)
    dims = {}
    for name, shape in tensors.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        scales = tensors.get(module + ".scales")
        ins = scales[-1] * group if scales else shape[1]
        dims[module] = (ins, shape[0])
    return dims


def _check_weights(folder: Path, model: Path, num_layers: int, covered: int, rank: int) -> None:
    if not (folder / WEIGHTS).is_file():
        raise ConfigError(f"--adapter {folder}: no {WEIGHTS} (an mlx_lm.lora output folder has it)")
    try:
        header, _, _ = read_safetensors_header(folder / WEIGHTS)
    except (IntegrityError, MissingInput) as e:
        raise ConfigError(f"--adapter {folder}: {WEIGHTS}: {e.message}") from None
    config = json.loads((model / "config.json").read_text())
    dims = _linear_dims(model, config)
    if not header:
        raise ConfigError(f"--adapter {folder}: {WEIGHTS} holds no tensors")
    for name, t in header.items():
        m = _LEAF.match(name)
        if m is None:
            raise ConfigError(f"--adapter {folder}: {name} is not a LoRA weight (lora_a, lora_b or m of a block)")
        layer = int(m["layer"])
        if not num_layers - covered <= layer < num_layers:
            raise ConfigError(f"--adapter {folder}: {name} is for layer {layer}, outside the last {covered} of the "
                             f"model's {num_layers} layers its config names")
        module = m["module"].removesuffix(".linear")
        if module not in dims:
            continue  # not a plain linear (experts, embeddings): the ranks check its shape when they load it
        ins, outs = dims[module]
        want = {"lora_a": [ins, rank], "lora_b": [rank, outs], "m": [outs]}[m["leaf"]]
        if t["shape"] != want:
            raise ConfigError(f"--adapter {folder}: {name} has shape {t['shape']}, the model's {module} "
                             f"({ins} in, {outs} out) with rank {rank} needs {want}")


def inspect_adapter(folder: Path, model: Path, num_layers: int, nodes: dict[str, tuple[str, bool]]) -> AdapterRef:
    """The adapter at ``folder`` for ``model``; ``nodes``: node -> (its model folder, whether it is this machine).
    A local node reads the coordinator's copy; another node gets its own under its model folder."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise ConfigError(f"--adapter {folder}: no such folder")
    kind, covered, rank = _config(folder, num_layers)
    _check_weights(folder, model, num_layers, covered, rank)
    manifest = build_manifest(folder, cache=HashCache())
    digest = manifest.manifest_hash
    return AdapterRef(source_path=str(folder), manifest_hash=digest, fine_tune_type=kind, num_layers=covered,
                      rank=rank, path_map=node_paths(str(folder), digest, nodes))


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
