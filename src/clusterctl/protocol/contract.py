"""Rank contracts: what one rank on one node is told to run, signed and bound to that node.

The launcher writes ``<runtime_dir>/<job>-rank<r>.contract`` (mode 0600) on the node. It carries the rank's spec
(ports, hostfile, nonce, API key, layers, model path) and the deployment's proof instead of the deployment file:
its id, plan hash, the sha256 of the signed file and that file's own signature, plus this rank's row of it (node,
layers, world, backend, model path), copied from the verified deployment and checked against the spec before the
launcher signs. The spec holds this rank's own layer range, not every rank's layer count. So a contract is a few KB
whatever the cluster's size (the deployment file grows with nodes and
layers: 1.15 MB at 1,000 x 1,000). The rank verifies the contract's signature (type ``rank-contract/<node>``: a
contract for node A never verifies on node B) and checks its spec against that row. Trusted public keys live in
``<runtime_dir>/trusted-keys/*.pub``. Version 1 (the whole deployment embedded) is still read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from clusterctl.atomic import read_capped, strict_loads
from clusterctl.errors import IntegrityError
from clusterctl.protocol.deployment import Deployment, decode
from clusterctl.protocol.signing import _TAIL, PublicKey, SigningKey, sign_payload, verify_signed
from clusterctl.protocol.rankspec import parse_rank_spec
from clusterctl.protocol.runtimefiles import TRUSTED_KEYS

CONTRACT_SCHEMA = 2
MAX_CONTRACT_BYTES = 4 << 20


def contract_kind(node: str) -> str:
    return f"rank-contract/{node}"


@dataclass(frozen=True)
class DeploymentProof:
    """What a contract says of its deployment: computed once per launch, not once per node."""

    deployment_id: str
    plan_hash: str
    sha256: str
    signature: dict
    backend: str
    world_size: int
    rows: dict  # node -> {"rank", "start_layer", "end_layer", "model_path"}

    def block(self, node: str) -> dict:
        return {"id": self.deployment_id, "plan_hash": self.plan_hash, "sha256": self.sha256,
                "signature": self.signature, "backend": self.backend, "world_size": self.world_size,
                "assignment": {"node": node, **self.rows[node]}}


def deployment_proof(deployment_file: bytes, dep: Deployment) -> DeploymentProof:
    """The proof of an already verified deployment (``dep`` parsed from ``deployment_file``)."""
    m = _TAIL.search(deployment_file)
    if m is None:
        raise IntegrityError(f"deployment {dep.deployment_id} is not signed")
    rows = {r.node: {"rank": r.rank, "start_layer": r.start_layer, "end_layer": r.end_layer,
                     "model_path": dep.path_map.get(r.node)} for r in dep.ranks}
    return DeploymentProof(deployment_id=dep.deployment_id, plan_hash=dep.plan_hash,
                           sha256=hashlib.sha256(deployment_file).hexdigest(),
                           signature={"key_id": m.group(1).decode(), "value": m.group(2).decode()},
                           backend=dep.backend, world_size=len(dep.ranks), rows=rows)


def encode_contract(deployment: bytes | DeploymentProof, spec: dict, key: SigningKey) -> bytes:
    """Sign ``spec`` for its node. ``deployment``: the proof (``deployment_proof``), or the signed deployment file
    (verified with ``key``'s own public key). Refuses (IntegrityError) a spec its deployment does not give."""
    proof = deployment if isinstance(deployment, DeploymentProof) else \
        deployment_proof(deployment, decode(deployment, [key.public], source="deployment").deployment)
    node = spec.get("node")
    if node not in proof.rows:
        raise IntegrityError(f"node {node} has no rank in deployment {proof.deployment_id}")
    block = proof.block(node)
    _check(spec, block, f"the contract of node {node}")
    doc = {"schema_version": CONTRACT_SCHEMA, "type": "rank-contract", "node": node, "rank": spec["rank"],
           "job_id": spec["job_id"], "deployment_id": spec["deployment_id"], "deployment": block, "spec": spec}
    # compact JSON from the C encoder (pretty-printing goes through the pure-Python one: a quarter of a 1,000-node
    # replan's CPU), in the signed-file frame ("{\n" ... "\n}\n") the signature is appended to
    compact = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return sign_payload(b"{\n" + compact[1:-1] + b"\n}\n", contract_kind(node), key)


def _check(spec, block: dict, source: str) -> None:
    """The spec (a dict or a RankSpec) against its deployment's row: node, rank, layers, world, backend, path."""
    get = spec.get if isinstance(spec, dict) else lambda k: getattr(spec, k, None)
    row = block.get("assignment")
    if not isinstance(row, dict):
        raise IntegrityError(f"{source} names no rank of its deployment")
    dep_id = block.get("id")
    if get("deployment_id") != dep_id:
        raise IntegrityError(f"{source} names deployment {get('deployment_id')}, it carries {dep_id}")
    if get("node") != row.get("node") or get("rank") != row.get("rank"):
        raise IntegrityError(f"{source}: rank {get('rank')} of {dep_id} runs on {row.get('node')} as rank "
                             f"{row.get('rank')}, not on {get('node')}")
    if (get("start_layer"), get("end_layer")) != (row.get("start_layer"), row.get("end_layer")) \
            or get("world_size") != block.get("world_size") or (get("backend") or "ring") != block.get("backend"):
        raise IntegrityError(f"{source} disagrees with deployment {dep_id} on layers, world or backend")
    if get("model_path") != row.get("model_path"):
        raise IntegrityError(f"{source}: model path is not the deployment's path_map entry for {get('node')}")


def trusted_keys(folder: Path) -> list[PublicKey]:
    keys = []
    try:
        entries = sorted(folder.glob("*.pub"))
    except OSError:
        entries = []
    for p in entries:
        try:
            keys.append(PublicKey.from_text(read_capped(p, limit=4096, what="public key").decode(), source=str(p)))
        except (IntegrityError, UnicodeDecodeError):
            continue
    return keys


def _v1_block(doc: dict, node: str, keys: list[PublicKey], source: str) -> dict:
    """A version-1 contract's deployment (embedded, signed) as the version-2 block of ``node``."""
    dep: Deployment = decode(str(doc.get("deployment", "")).encode(), keys,
                             source=f"deployment inside {source}").deployment
    row = next(({"node": r.node, "rank": r.rank, "start_layer": r.start_layer, "end_layer": r.end_layer,
                 "model_path": dep.path_map.get(r.node)} for r in dep.ranks
                if r.rank == doc.get("rank") or (doc.get("rank") is None and r.node == node)), None)
    if row is None:
        raise IntegrityError(f"{source}: rank {doc.get('rank')} is not in deployment {dep.deployment_id}")
    return {"id": dep.deployment_id, "backend": dep.backend, "world_size": len(dep.ranks), "assignment": row}


def read_contract(data: bytes, node: str, keys: list[PublicKey], *, source: str):
    """The one reader of a rank contract: verify ``data``'s signature for ``node`` with ``keys`` and return its
    RankSpec, checked against the deployment's row it carries. The rank reads its own contract with it
    (``load_rank_contract``), the front door rank 0's (front/follow.py). IntegrityError (exit 65) on anything off."""

    payload = verify_signed(data, contract_kind(node), keys, source=source)
    doc = strict_loads(payload, source=source)
    if not isinstance(doc, dict) or doc.get("type") != "rank-contract" or doc.get("schema_version") not in (1, 2):
        raise IntegrityError(f"{source} has an unknown type or version")
    block = _v1_block(doc, node, keys, source) if doc["schema_version"] == 1 else doc.get("deployment")
    if not isinstance(block, dict):
        raise IntegrityError(f"{source} carries no deployment proof")
    spec = parse_rank_spec(doc.get("spec"), source=source)
    if spec.node != node or doc.get("node") != node:
        raise IntegrityError(f"{source} is for node {spec.node}, not {node}")
    if doc.get("rank") != spec.rank or doc.get("job_id") != spec.job_id \
            or doc.get("deployment_id") != spec.deployment_id:
        raise IntegrityError(f"{source}: its header and its spec name different ranks or jobs")
    _check(spec, block, source)
    return spec


def load_rank_contract(path: str | Path, node: str):
    """The rank's own contract at ``path``, read with the trusted keys of its runtime dir (``read_contract``)."""

    path = Path(path)
    data = read_capped(path, limit=MAX_CONTRACT_BYTES, what="rank contract")
    return read_contract(data, node, trusted_keys(path.parent / TRUSTED_KEYS), source=f"rank contract {path}")
