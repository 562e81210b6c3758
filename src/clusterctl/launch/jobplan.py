"""The job plan: everything a launch decides before it starts a rank, as data, with no I/O.

(deployment, launch options, port block, runtime dirs, rank addresses, job id, nonce) -> ``JobPlan``: the
validated ``RankSpec`` of every rank (a wrong field fails here, on the operator's machine, not as exit 65 on a
remote rank), the launch-manifest records, and the files every node gets. ``launch/start.py`` executes it.
The clock and the randomness (job id, nonce, port block) are chosen by the caller: ``new_job_id``/``new_nonce``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from clusterctl.launch import hostfile
from clusterctl.protocol import runtimefiles as rf
from clusterctl.statedir.manifest import RankRecord
from clusterctl.connect.nodes import Connector
from clusterctl.protocol.rankspec import RankSpec, parse_rank_spec
from clusterctl.launch.teardown import DEFAULT_GRACE
from clusterctl.protocol.deployment import Deployment

DEFAULT_LEASE = 30.0  # (the CLI reads CLUSTERCTL_LAUNCHER_LEASE: cli/options.py lease_from_env; this module reads no
# environment)


class LaunchOptions(BaseModel):
    """How a job is launched, as its command settled it (cli/launchflags.py builds it from the flags of launch,
    replan and supervise). Frozen: what changes later (a supervisor's port and host) is a copy,
    ``opts.model_copy(update=...)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout: float = 600.0
    grace: float = DEFAULT_GRACE
    lease_seconds: float = DEFAULT_LEASE
    detach: bool = False
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    api_key: str | None = None
    api_keys: dict[str, str] = Field(default_factory=dict)  # more tenants: name -> key (docs/security.md)
    cors_origins: list[str] = Field(default_factory=list)  # browser origins rank 0 answers with CORS headers
    model_aliases: list[str] = Field(default_factory=list)  # more names rank 0 answers to as `model`
    seed: int = 0
    max_queue: int = 64  # requests rank 0 holds beyond the batch before answering 429
    canary: bool = True
    ssh: Connector = Field(default_factory=Connector)
    check_model: bool = True
    verify_model: bool = False  # preflight re-hashes every byte of each node's model copy
    reap_first: bool = True

    @property
    def any_key(self) -> str | None:
        """A key rank 0 accepts (the canary's): the default tenant's, else the first other tenant's."""
        return self.api_key or next(iter(self.api_keys.values()), None)


def mlx_view(rank_env: dict[str, str]) -> dict[str, str]:
    """What the mlx.launch-compatible hostfile records of the environment every rank applies (protocol/rankspec.py's
    MLX_ENV_DEFAULTS): its MLX_ variables."""
    return {k: v for k, v in rank_env.items() if k.startswith("MLX_")}


def new_job_id(deployment_id: str, *, when: float | None = None, token: str | None = None) -> str:
    """``<deployment>-<UTC-less local timestamp>-<6 hex>``: unique per launch, sortable by time."""
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(when) if when is not None else time.localtime())
    return f"{deployment_id}-{stamp}-{token or secrets.token_hex(3)}"


def new_nonce() -> str:
    return secrets.token_hex(16)


def port_split(world: int, block: list[int], http_port: int | None) -> tuple[list[int], int]:
    """A block of world + 1 ports -> (one ring port per rank, rank 0's HTTP port unless the operator fixed it)."""
    return block[:world], (http_port or block[world])


def port_requests(dep: Deployment, block: list[int], http_port: int | None) -> dict[str, list[int]]:
    """The ports each node must find free in preflight: its ring port (world > 1) and, on rank 0, HTTP."""
    world = len(dep.ranks)
    ring, http = port_split(world, block, http_port)
    return {r.node: ([ring[r.rank]] if world > 1 else []) + ([http] if r.rank == 0 else []) for r in dep.ranks}


@dataclass(frozen=True)
class NodeFile:
    """One file a launch writes on a node before the ranks start. ``spec`` set: a rank contract, signed (with
    the deployment file inside) when it is written; otherwise ``data`` is the content."""

    node: str
    path: str
    kind: str  # trusted-key | hostfile | contract
    mode: int = 0o600
    data: bytes = b""
    spec: RankSpec | None = None

    def to_json(self) -> dict:
        out = {"node": self.node, "path": self.path, "kind": self.kind, "mode": oct(self.mode)}
        if self.spec is None:
            out["data"] = self.data.decode("utf-8", "replace")
        return out


@dataclass(frozen=True)
class PlannedRank:
    rank: int
    node: str
    runtime_dir: str
    spec: RankSpec
    record: RankRecord


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    nonce: str
    deployment_id: str
    block: list[int]
    ring_ports: list[int]
    http_port: int
    lease_seconds: float  # 0: no lease (a detached job)
    ranks: list[PlannedRank]
    files: list[NodeFile]
    mlx_launch_hostfile: dict

    @property
    def world(self) -> int:
        return len(self.ranks)

    def records(self) -> list[RankRecord]:
        """Fresh manifest records (the launch fills in pid and state as ranks start)."""
        return [r.record.model_copy() for r in self.ranks]  # scalars only: a shallow copy is a fresh record

    def files_of(self, node: str) -> list[NodeFile]:
        return [f for f in self.files if f.node == node]

    def gate_paths(self) -> dict[str, str]:
        return {r.node: r.spec.gate_path for r in self.ranks}

    def lease_paths(self) -> dict[str, str]:
        return {r.node: r.spec.lease_path for r in self.ranks if r.spec.lease_path}

    def to_json(self) -> dict:
        """The plan as data (the API key masked): what the golden tests compare."""
        return {"job_id": self.job_id, "nonce": self.nonce, "deployment_id": self.deployment_id,
                "block": self.block, "ring_ports": self.ring_ports, "http_port": self.http_port,
                "lease_seconds": self.lease_seconds,
                "ranks": [{"rank": r.rank, "node": r.node, "runtime_dir": r.runtime_dir,
                           "spec": r.spec.model_dump(mode="json", exclude_unset=True),
                           "record": r.record.model_dump(mode="json")} for r in self.ranks],
                "files": [f.to_json() for f in self.files], "mlx_launch_hostfile": self.mlx_launch_hostfile}


def contract_payload(spec: RankSpec) -> dict:
    """The spec as the contract carries it: the fields the launcher set, the API key in clear."""
    doc = spec.model_dump(mode="json", exclude_unset=True)
    if "api_key" in doc:
        doc["api_key"] = spec.api_key_value()
    if "api_keys" in doc:
        doc["api_keys"] = {name: k.get_secret_value() for name, k in spec.api_keys.items()}
    return doc


def plan_job(dep: Deployment, opts: LaunchOptions, *, block: list[int], runtime_dirs: dict[str, str],
             addrs: list[str], job_id: str, nonce: str, trusted_key: tuple[str, str], abort_grace_s: float,
             compute_nice: int, mlx_env: dict[str, str]) -> JobPlan:
    """The whole job as data. ``trusted_key`` is (key id, public key text); ``addrs`` one rank address per rank
    (``hostfile.rank_address``); ``abort_grace_s`` and ``compute_nice`` the ranks' settings from this
    machine's environment; ``mlx_env`` the MLX environment every rank applies (recorded in the
    mlx.launch-compatible hostfile, so an operator can reproduce a launch by hand). Raises IntegrityError when
    a rank's spec would not validate."""
    world = len(dep.ranks)
    ring_ports, http_port = port_split(world, block, opts.http_port)
    lease_seconds = 0.0 if opts.detach else opts.lease_seconds
    hostfiles = hostfile.ring_hostfiles(addrs, ring_ports) if world > 1 else None
    ranks: list[PlannedRank] = []
    files: list[NodeFile] = []
    encoded: dict[int, bytes] = {}
    for r, node in zip(dep.ranks, dep.rank_nodes()):
        d = runtime_dirs[r.node]
        names = rf.RankFiles(d, job_id, r.rank)
        rec = RankRecord(rank=r.rank, node=r.node, host=node.host, local=node.is_local,
                         runtime_dir=d, marker_path=names.marker, contract_path=names.contract,
                         hostfile_path=names.hostfile if world > 1 else None,
                         log_path=names.log if opts.detach else None,
                         port=ring_ports[r.rank] if world > 1 else None,
                         start_layer=r.start_layer, end_layer=r.end_layer)
        doc = {"deployment_id": dep.deployment_id, "job_id": job_id, "nonce": nonce, "node": r.node,
               "rank": r.rank, "world_size": world, "backend": dep.backend, "parallel": dep.parallel,
               "schedule": dep.schedule or "overlap", "prompt_cache_tokens": dep.prompt_cache_tokens,
               "model_path": dep.path_map[r.node],
               **({"adapter_path": dep.adapter.path_map[r.node], "adapter_hash": dep.adapter.manifest_hash}
                  if dep.adapter is not None else {}),
               **({"kv_bits": dep.options.kv_bits, "kv_group_size": dep.options.kv_group_size,
                   "quantized_kv_start": dep.options.quantized_kv_start} if dep.options.kv_bits else {}),
               "start_layer": r.start_layer, "end_layer": r.end_layer,
               "num_layers": dep.model.num_layers, "hostfile": rec.hostfile_path,
               "http_host": opts.http_host, "http_port": http_port if r.rank == 0 else None,
               "api_key": opts.api_key if r.rank == 0 else None, "seed": opts.seed,
               **({"api_keys": dict(opts.api_keys)} if r.rank == 0 and opts.api_keys else {}),
               **({"cors_origins": list(opts.cors_origins)} if r.rank == 0 and opts.cors_origins else {}),
               **({"model_aliases": list(opts.model_aliases)} if r.rank == 0 and opts.model_aliases else {}),
               **({"served_name": dep.model.hub.repo_id} if r.rank == 0 and dep.model.hub else {}),
               "runtime_dir": d, "marker_path": rec.marker_path, "gate_path": rf.gate_path(d, job_id),
               "lease_path": rf.lease_path(d, job_id) if lease_seconds else None,
               "lease_seconds": lease_seconds or DEFAULT_LEASE, "embedding_offload": dep.embedding_offload,
               "abort_grace_s": abort_grace_s, "compute_nice": compute_nice, "max_batch": dep.batch_slots,
               "max_queue": opts.max_queue, "context_tokens": dep.options.context if r.rank == 0 else None,
               **({"serving": dep.options.serving.model_dump(mode="json", exclude_defaults=True)}
                  if r.rank == 0 and dep.options.serving is not None else {})}
        spec = parse_rank_spec(doc, source=f"the rank contract of rank {r.rank} on {r.node}")
        ranks.append(PlannedRank(rank=r.rank, node=r.node, runtime_dir=d, spec=spec, record=rec))
        key_id, key_text = trusted_key
        files.append(NodeFile(r.node, rf.trusted_key_path(d, key_id), "trusted-key", data=key_text.encode()))
        if hostfiles:
            hf = hostfiles[r.rank]  # every rank gets the same list (hostfile.ring_hostfiles): encoded once, not N times
            if id(hf) not in encoded:
                encoded[id(hf)] = json.dumps(hf).encode()
            files.append(NodeFile(r.node, names.hostfile, "hostfile", data=encoded[id(hf)]))
        files.append(NodeFile(r.node, names.contract, "contract", spec=spec))
    return JobPlan(job_id=job_id, nonce=nonce, deployment_id=dep.deployment_id, block=list(block),
                   ring_ports=ring_ports, http_port=http_port, lease_seconds=lease_seconds, ranks=ranks, files=files,
                   mlx_launch_hostfile=hostfile.mlx_launch_hostfile(dep, addrs, mlx_env))


def rank_addresses(dep: Deployment) -> list[str]:
    """One address per rank that the other ranks connect to (may resolve a host name: not pure)."""
    nodes = dep.rank_nodes()
    all_local = all(n.is_local for n in nodes)
    return [hostfile.rank_address(n, all_local=all_local, backend=dep.backend) for n in nodes]
