"""The job plan (launch/jobplan.py): pure, so its whole output is pinned by golden files for 1, 2 and 4 ranks.

Regenerate after an intended change with ``CLUSTERCTL_UPDATE_GOLDEN=1`` and review the diff like code.
"""

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from clusterctl.errors import IntegrityError
from clusterctl.launch.jobplan import (LaunchOptions, contract_payload, mlx_view, new_job_id, plan_job,
                                       port_requests, rank_addresses)
from clusterctl.protocol.rankspec import MLX_ENV_DEFAULTS
from clusterctl.protocol.rankspec import RankSpec
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment

from modelfiles import make_model

GOLDEN = Path(__file__).parent / "golden"
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
KEY = ("0123456789abcdef", "clusterctl-ed25519 AAAA 0123456789abcdef\n")


def deployment(tmp_path, n: int):
    nodes = [{"name": "abcd"[i], "memory_gb": 64, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"],
              "model_path": "/models/m"} for i in range(n)]
    cluster = parse_cluster({"cluster": {"name": "lab"}, "node": nodes})
    facts = inspect_model(make_model(tmp_path / "m", layers=8, hidden=64))
    return make_deployment(cluster, facts, "/models/m", PlanOptions(allocation="balanced"), now=NOW)


def job(dep, opts=None, **kw):
    n = len(dep.ranks)
    args = dict(block=list(range(30000, 30000 + n + 1)), runtime_dirs={r.node: f"/run/{r.node}" for r in dep.ranks},
                addrs=rank_addresses(dep), job_id=f"{dep.deployment_id}-20260102030405-abc123", nonce="n" * 32,
                trusted_key=KEY, abort_grace_s=5.0, compute_nice=10, mlx_env=mlx_view(MLX_ENV_DEFAULTS))
    args.update(kw)
    return plan_job(dep, opts or LaunchOptions(lease_seconds=30.0, api_key="secret-key"), **args)


def normalized(doc: dict, dep) -> dict:
    """The golden form: the deployment id (a hash of the fixture model's facts) replaced by a placeholder."""
    return json.loads(json.dumps(doc).replace(dep.deployment_id, "<deployment>"))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_golden_job_plan(tmp_path, n):
    dep = deployment(tmp_path, n)
    got = normalized(job(dep).to_json(), dep)
    path = GOLDEN / f"jobplan-{n}.json"
    if os.environ.get("CLUSTERCTL_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())


def test_every_spec_validates_and_the_api_key_stays_out_of_the_plans_json(tmp_path):
    dep = deployment(tmp_path, 2)
    plan = job(dep)
    assert all(isinstance(r.spec, RankSpec) for r in plan.ranks)
    assert "secret-key" not in json.dumps(plan.to_json())
    payload = contract_payload(plan.ranks[0].spec)
    assert payload["api_key"] == "secret-key"  # the contract carries it in clear (the file is 0600)
    assert RankSpec.model_validate(payload) == plan.ranks[0].spec
    assert contract_payload(plan.ranks[1].spec)["api_key"] is None


def test_a_bad_value_fails_in_the_plan_before_any_node_is_touched(tmp_path):
    dep = deployment(tmp_path, 2)
    with pytest.raises(IntegrityError, match="max_queue"):
        job(dep, LaunchOptions(lease_seconds=30.0, max_queue=-1))


def test_a_detached_job_has_logs_and_no_lease(tmp_path):
    dep = deployment(tmp_path, 2)
    plan = job(dep, LaunchOptions(detach=True))
    assert plan.lease_seconds == 0 and plan.lease_paths() == {}
    assert all(r.record.log_path and r.record.log_path.endswith(".log") for r in plan.ranks)


def test_ports_and_the_fixed_http_port(tmp_path):
    dep = deployment(tmp_path, 2)
    assert port_requests(dep, [1, 2, 3], None) == {dep.ranks[0].node: [1, 3], dep.ranks[1].node: [2]}
    assert port_requests(dep, [1, 2, 3], 8080)[dep.ranks[0].node] == [1, 8080]
    assert job(dep, LaunchOptions(lease_seconds=30.0, http_port=8080)).http_port == 8080


def test_job_ids():
    assert re.fullmatch(r"d-\d{14}-[0-9a-f]{6}", new_job_id("d"))
    assert new_job_id("d", token="abc123").endswith("-abc123")


def test_every_rank_contract_carries_the_kv_cache_setting(tmp_path):
    """plan --kv-bits reaches every rank through its contract (what rank/engine/kvquant.py quantizes by)."""
    cluster = parse_cluster({"cluster": {"name": "lab"}, "node": [
        {"name": n, "memory_gb": 64, "host": f"10.0.0.{i + 1}", "ips": [f"10.0.0.{i + 1}"], "model_path": "/models/m"}
        for i, n in enumerate("ab")]})
    facts = inspect_model(make_model(tmp_path / "m", layers=8, hidden=256))
    dep = make_deployment(cluster, facts, "/models/m", PlanOptions(kv_bits=8, kv_group_size=32,
                                                                   quantized_kv_start=100), now=NOW)
    for r in job(dep).ranks:
        spec = RankSpec.model_validate(contract_payload(r.spec))
        assert (spec.kv_bits, spec.kv_group_size, spec.quantized_kv_start) == (8, 32, 100)
    plain = job(deployment(tmp_path / "plain", 2)).ranks[0].spec
    assert plain.kv_bits is None and "kv_bits" not in contract_payload(plain)
