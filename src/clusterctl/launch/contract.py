"""Rank contracts: what one rank on one node is told to run, signed and bound to that node.

The launcher writes ``<runtime_dir>/<job>-rank<r>.contract`` (mode 0600) on the node. It carries the signed
deployment file itself plus the job's facts (ports, hostfile, nonce, API key). The rank verifies the contract's
signature (type ``rank-contract/<node>``: a contract for node A never verifies on node B), then the embedded
deployment's, and derives its model path and layer range from the deployment — never from a command line.
Trusted public keys live in ``<runtime_dir>/trusted-keys/*.pub``.
"""

from __future__ import annotations

from pathlib import Path

from clusterctl.atomic import dumps, read_capped, strict_loads
from clusterctl.errors import IntegrityError
from clusterctl.plan.deployment import Deployment, decode
from clusterctl.plan.signing import PublicKey, SigningKey, sign_payload, verify_signed

CONTRACT_SCHEMA = 1
MAX_CONTRACT_BYTES = 4 << 20


def contract_kind(node: str) -> str:
    return f"rank-contract/{node}"


def encode_contract(deployment_file: bytes, spec: dict, key: SigningKey) -> bytes:
    doc = {"schema_version": CONTRACT_SCHEMA, "type": "rank-contract", "node": spec["node"], "rank": spec["rank"],
           "job_id": spec["job_id"], "deployment_id": spec["deployment_id"],
           "deployment": deployment_file.decode("utf-8"), "spec": spec}
    return sign_payload(dumps(doc), contract_kind(spec["node"]), key)


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


def load_rank_contract(path: str | Path, node: str):
    """Verify and return the RankSpec of a contract for ``node``. IntegrityError (exit 65) on anything off."""
    from clusterctl.launch.rankspec import parse_rank_spec

    path = Path(path)
    data = read_capped(path, limit=MAX_CONTRACT_BYTES, what="rank contract")
    from clusterctl.launch.runtimefiles import TRUSTED_KEYS

    keys = trusted_keys(path.parent / TRUSTED_KEYS)
    payload = verify_signed(data, contract_kind(node), keys, source=f"rank contract {path}")
    doc = strict_loads(payload, source=f"rank contract {path}")
    if not isinstance(doc, dict) or doc.get("type") != "rank-contract" or doc.get("schema_version") != CONTRACT_SCHEMA:
        raise IntegrityError(f"rank contract {path} has an unknown type or version")
    dep: Deployment = decode(str(doc.get("deployment", "")).encode(), keys,
                             source=f"deployment inside {path}").deployment
    spec = parse_rank_spec(doc.get("spec"), source=f"rank contract {path}")
    if spec.node != node or doc.get("node") != node:
        raise IntegrityError(f"rank contract {path} is for node {spec.node}, not {node}")
    if spec.deployment_id != dep.deployment_id:
        raise IntegrityError(f"rank contract {path} names deployment {spec.deployment_id}, it carries {dep.deployment_id}")
    try:
        assignment = dep.ranks[spec.rank]
    except IndexError:
        raise IntegrityError(f"rank contract {path}: rank {spec.rank} is not in deployment {dep.deployment_id}") from None
    if assignment.node != node:
        raise IntegrityError(f"rank contract {path}: rank {spec.rank} of {dep.deployment_id} runs on {assignment.node}, not {node}")
    if (spec.start_layer, spec.end_layer) != (assignment.start_layer, assignment.end_layer) \
            or spec.world_size != len(dep.ranks) or spec.backend != dep.backend:
        raise IntegrityError(f"rank contract {path} disagrees with deployment {dep.deployment_id} on layers, world or backend")
    if spec.model_path != dep.path_map.get(node):
        raise IntegrityError(f"rank contract {path}: model path is not the deployment's path_map entry for {node}")
    return spec
