"""A healthy fake node, for the fake transport (connect/faketransport.py): a whole launch, status, teardown, reap or
cancel runs against it with the real coordinator code, in milliseconds, at any node count (bench/scale.py).

``SimulatedNode`` answers every node operation the coordinator sends as a healthy node would: preflight's probe
with the coordinator's own versions and room to spare, files kept in memory, a rank started (detached ``spawn``
or foreground ``start``) writes a ``serving`` marker at once (its facts read from the contract it was given),
markers, alive, sweep, clean and canary as expected. Each answer comes back ``rtt`` seconds after its request.

    nodes = {f"n{i}": SimulatedNode(rtt=0.05) for i in range(256)}
    running = asyncio.run(launch(dep_file, state, LaunchOptions(check_model=False, ssh=fake_ssh(nodes))))
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.connect.faketransport import ScriptedOps
from clusterctl.launch.jobplan import LaunchOptions, contract_payload, mlx_view, plan_job, rank_addresses
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import ModelFacts
from clusterctl.plan.planner import make_deployment
from clusterctl.protocol.contract import deployment_proof, encode_contract
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.protocol.rankspec import MLX_ENV_DEFAULTS
from clusterctl.protocol.versions import coordinator_versions, python_version
from clusterctl.statedir.state import StateDir


@dataclass
class SimulatedNode(ScriptedOps):
    rtt: float = 0.0
    runtime_dir: str = "/run/fake"
    running: dict = field(default_factory=dict)  # pid -> marker path

    async def answer(self, op: str, req: dict) -> dict:
        if self.rtt:
            await asyncio.sleep(self.rtt)
        return await super().answer(op, req)

    def _op_warm(self, req: dict) -> dict:
        return {"imported": list(req.get("modules", [])), "failed": {}}

    def _op_probe(self, req: dict) -> dict:
        out = {"hostname": "fake", "boot_id": "fake-boot", "time": time.time(), "versions": {"python": python_version(), **coordinator_versions()},
               "mem_available": 1 << 40, "mem_total": 1 << 40, "default_runtime_dir": self.runtime_dir,
               "runtime_dir": {"path": req.get("runtime_dir") or self.runtime_dir, "ok": True}}
        if req.get("backend"):
            out["backend_available"] = True
        if req.get("model_path"):
            out["model"] = {"ok": True, "files": []}
            if req.get("manifest"):
                out["model_copy"] = {"state": "ok"}
        if req.get("ports"):
            out["ports_busy"] = []
        return out

    def _rank_started(self, argv: list[str], pid: int) -> None:
        contract = argv[argv.index("--contract") + 1]
        spec = json.loads(self.files[contract])["spec"]
        marker = {"schema_version": 1, "type": "rank-marker", "deployment_id": spec["deployment_id"],
                  "job_id": spec["job_id"], "nonce": spec["nonce"], "rank": spec["rank"], "node": spec["node"],
                  "host": "fake", "pid": pid, "pgid": pid, "start_time": 1.0, "boot_id": "fake-boot",
                  "state": "serving", "heartbeat_at": time.time(),
                  "endpoint": f"http://127.0.0.1:{spec['http_port']}" if spec.get("http_port") else None}
        self.put_json(spec["marker_path"], marker)
        self.running[pid] = spec["marker_path"]

    def _op_spawn(self, req: dict) -> dict:
        return self._op_start(req)

    def _op_start(self, req: dict) -> dict:
        info = super()._op_start(req)
        if "--contract" in req["argv"]:
            self._rank_started(req["argv"], info["pid"])
        return info

    def _marker(self, path: str):
        data = self.files.get(path)
        return json.loads(data) if data is not None else None

    def _op_wait_markers(self, req: dict) -> dict:
        return {"markers": [self._marker(p) for p in req["paths"]], "exited": [None] * len(req["paths"])}

    def _job_markers(self, req: dict) -> list[str]:
        prefix = f"{req['runtime_dir'].rstrip('/')}/{req['job_id']}-rank"
        return [p for p in self.files if p.startswith(prefix) and p.endswith(".json")
                and p[len(prefix):-5].isdigit()]

    def _op_markers(self, req: dict) -> dict:
        return {"markers": [{"path": p, "marker": self._marker(p), "age": 0.1} for p in self._job_markers(req)],
                "time": time.time()}

    def _op_alive(self, req: dict) -> dict:
        return {"status": ["alive" if t.get("pid") in self.running else "dead" for t in req.get("targets", [])]}

    def _op_sweep(self, req: dict) -> dict:
        results = []
        for p in self._job_markers(req):
            pid = (self._marker(p) or {}).get("pid")
            self.running.pop(pid, None)
            if pid is not None:
                results.append({"pid": pid, "status": "gone", "detail": ""})
        for t in req.get("extra", []):
            self.running.pop(t.get("pid"), None)
            results.append({"pid": t.get("pid"), "status": "gone", "detail": ""})
        return {"results": results}

    def _op_clean(self, req: dict) -> dict:
        prefix = f"{req['runtime_dir'].rstrip('/')}/{req['job_id']}"
        removed = [p for p in self.files if p.startswith(prefix)]
        for p in removed:
            del self.files[p]
        return {"removed": removed}

    def _op_canary(self, req: dict) -> dict:
        return {"ok": True, "tokens": 2, "text": "hi", "seconds": 0.0}

    def requests(self) -> int:
        return len(self.calls)


def simulated_deployment(state: StateDir, nodes: int, *, layers: int | None = None, ips: bool = True) -> str:
    """A signed deployment of ``nodes`` remote nodes ``n0000``... (each with ``ips``: no name lookups, unless
    ``ips=False``: then each is host ``n0000.sim`` and launch resolves it) over a
    synthetic model of ``layers`` (default: one per node), saved in ``state``; returns its path. Launch it with
    ``LaunchOptions(check_model=False)``: there is no model folder to check."""

    layers = layers or nodes
    facts = ModelFacts(name="synthetic", model_type="qwen2", num_layers=layers, hidden_size=1024, num_heads=16,
                       num_kv_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False,
                       layer_bytes=[64 << 20] * layers, shared_bytes=256 << 20, kv_dtype_bytes=2,
                       facts_hash="0" * 64, files=["model.safetensors"])
    cluster = parse_cluster({"cluster": {"name": f"sim{nodes}"}, "node": [
        {"name": f"n{i:04d}", **({"host": f"10.{i // 250}.{i % 250}.1", "ips": [f"10.{i // 250}.{i % 250}.1"]}
                                 if ips else {"host": f"n{i:04d}.sim"}),
         "memory_gb": 64, "model_path": "/models/m", "runtime_dir": "/run/fake"} for i in range(nodes)]})
    dep = make_deployment(cluster, facts, "/models/m", PlanOptions())
    if len(dep.ranks) != nodes:
        raise ValueError(f"the plan used {len(dep.ranks)} of {nodes} nodes")
    return str(state.save_deployment(dep)[-1])


def simulated_contracts(state: StateDir, path: str) -> dict[str, bytes]:
    """Every rank's signed contract for a launch of the simulated deployment at ``path``, planned and signed as
    launch plans and signs them (job id and nonce fixed), with no node to talk to: what bench/scale.py and the
    tests measure of contracts per node. Node name -> contract bytes."""
    _, loaded = state.load_deployment(path)
    dep, n = loaded.deployment, len(loaded.deployment.ranks)
    pub, key = state.keyring.public_keys()[0], state.keyring.signing_key()
    plan = plan_job(dep, LaunchOptions(check_model=False, detach=True), block=list(range(30000, 30001 + n)),
                    runtime_dirs={r.node: "/run/fake" for r in dep.ranks}, addrs=rank_addresses(dep),
                    job_id=f"{dep.deployment_id}-20260102030405-abc123", nonce="n" * 32,
                    trusted_key=(pub.key_id, pub.to_text()), abort_grace_s=5.0, compute_nice=10,
                    mlx_env=mlx_view(MLX_ENV_DEFAULTS))
    proof = deployment_proof(Path(path).read_bytes(), dep)
    return {f.node: encode_contract(proof, contract_payload(f.spec), key) for f in plan.files if f.spec is not None}
