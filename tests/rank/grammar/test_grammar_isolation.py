"""One key holder's schemas cannot stall another tenant's stream (issue 41, item 1), on 2 real ranks of each decode
schedule: grammars compile off every rank's step loop, costly ones are refused at admission by their kind, and the
ones admitted are served to their end. Measured against the victim's own gaps between tokens, never a wall-clock
constant."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time

import pytest

from admissionfuzz import costly_schemas
from rankharness import RankCluster

pytestmark = pytest.mark.slow

PROMPT = "def main(argv):"
VICTIM_TOKENS = 100  # within the shared clusters' planned context of 128 tokens


def post(c: RankCluster, body: dict, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


def victim_gaps(c: RankCluster, started: threading.Event | None = None) -> list[float]:
    """A greedy stream's gaps between consecutive tokens (the first token, after the prompt, not counted)."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "prompt": PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    times = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
            if started is not None and len(times) == 2:
                started.set()
    conn.close()
    assert len(times) >= VICTIM_TOKENS // 2, len(times)
    return [b - a for a, b in zip(times[1:], times[2:])]


def test_hostile_schemas_do_not_stall_another_stream(cluster):
    """8 hostile schemas (costly compiles whose names vary, so no cache helps; grammars whose masks cost too much
    or allow what their parser refuses; strings no answer can close) arrive while a victim streams: its longest gap
    stays under twice its longest gap when ordinary traffic arrives instead. The costly ones are 400s naming their
    cost before any compute; the ones admitted end normally (no error after the compute).

    The baseline: two of the 8 hostile requests are admitted and served (the endless strings), and a request that
    joins costs the running streams a gap of its own (its prompt, and a meeting: docs/rank.md). So the victim is
    measured against itself while two ordinary constrained requests join at the same moment (a clean-clone CI run
    against the victim alone failed 5 rounds of 5 at 3.3-4x: 81-150 ms alone, 305-549 ms attacked; on a loaded
    machine two ordinary joins alone took it from 104-334 ms to 208-569 ms). The machine these tests share is loaded
    by other work, so one stream's longest gap is mostly the machine's: up to 5 rounds, each with new schema names.
    One compile on a step loop (0.7-3 s for such a schema) stalls every round's victim: on the code this replaced
    the attacked gaps were 0.6-1.6 s against 0.1-0.2 s alone."""
    post(cluster, {"prompt": PROMPT, "max_tokens": 2, "response_format": {"type": "json_object"}})  # warm
    rounds = []
    for _ in range(5):
        tag = cluster.overrides["schedule"][0] + "".join(random.choice("abcdefghij") for _ in range(4))
        ordinary = max(beside(cluster, ordinary_schemas(tag)) for _ in range(2))
        worst = beside(cluster, costly_schemas(tag))
        rounds.append(f"{worst * 1000:.0f} ms attacked, {ordinary * 1000:.0f} ms beside ordinary joins")
        if worst < 2 * ordinary:
            return
    pytest.fail("the victim's longest gap with hostile schemas: " + "; ".join(rounds))


def ordinary_schemas(tag: str) -> list[tuple[str, dict]]:
    """Two cheap schemas an ordinary client sends (one object with an integer), admitted and served like the
    hostile endless strings."""
    return [(f"ordinary {i}", {"type": "object", "required": [f"k{tag}{i}"],
                               "properties": {f"k{tag}{i}": {"type": "integer"}}}) for i in range(2)]


def beside(cluster, schemas: list[tuple[str, dict]]) -> float:
    """The victim's longest gap while ``schemas`` arrive; their answers checked."""
    results: list[tuple[str, int, dict]] = []
    started = threading.Event()

    def attack(name, schema):
        started.wait(60)
        results.append((name, *post(cluster, {"prompt": PROMPT, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})))

    attackers = [threading.Thread(target=attack, args=item) for item in schemas]
    for t in attackers:
        t.start()
    worst = max(victim_gaps(cluster, started))
    for t in attackers:
        t.join(180)
    assert len(results) == len(schemas)
    for name, status, out in results:
        if name.startswith(("endless", "ordinary")):  # admitted: served to its end, no error after compute
            assert status == 200, (name, out)
            assert name.startswith("ordinary") or out["choices"][0]["finish_reason"] == "length", (name, out)
        else:  # refused before any compute, naming its cost
            assert status == 400 and out["error"]["code"] == "grammar_too_costly", (name, out)
            assert out["error"]["param"] == "response_format", out
    return worst
