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
    stays under twice its longest gap alone. The costly ones are 400s naming their cost before any compute; the
    ones admitted end normally (no error after the compute).

    The machine these tests share is loaded by other work, so one stream's longest gap is mostly the machine's: a
    round measures the victim alone (2 streams) and then attacked, and up to 5 rounds are run, each with new schema
    names (3 rounds all failed once with a fault campaign running beside the suite: 2.2-3.3x). One compile on a step loop (0.7-3 s for such a schema) stalls every round's victim: on the code this
    replaced the attacked gaps were 0.6-1.6 s against 0.1-0.2 s alone."""
    post(cluster, {"prompt": PROMPT, "max_tokens": 2, "response_format": {"type": "json_object"}})  # warm
    rounds = []
    for _ in range(5):
        alone = max(max(victim_gaps(cluster)) for _ in range(2))
        worst = attacked(cluster)
        rounds.append(f"{worst * 1000:.0f} ms attacked, {alone * 1000:.0f} ms alone")
        if worst < 2 * alone:
            return
    pytest.fail("the victim's longest gap with hostile schemas: " + "; ".join(rounds))


def attacked(cluster) -> float:
    """The victim's longest gap while the hostile schemas arrive; their answers checked."""
    tag = cluster.overrides["schedule"][0] + "".join(random.choice("abcdefghij") for _ in range(4))
    schemas = costly_schemas(tag)
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
    assert len(results) == len(schemas) == 8
    for name, status, out in results:
        if name.startswith("endless"):  # admitted: served to its end (cut by max_tokens), no error after compute
            assert status == 200 and out["choices"][0]["finish_reason"] == "length", (name, out)
        else:  # refused before any compute, naming its cost
            assert status == 400 and out["error"]["code"] == "grammar_too_costly", (name, out)
            assert out["error"]["param"] == "response_format", out
    return worst
