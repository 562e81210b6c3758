"""The embedded default: a real 2-rank local cluster serving the locally built tiny model, end to end.

build (or reuse) the tiny model -> write a 2-node local cluster.toml (memory split so the proportional plan is
uneven) -> plan -> launch -> one streamed chat request through rank 0's OpenAI-compatible API -> status ->
verified teardown -> summary. Every step is the same code the commands use; it fails loudly if any step does.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import ClusterctlError, Exit

DEMO_CLUSTER = """\
# Written by `clusterctl demo`: two local nodes on this machine. The memory split (2 : 6 GiB) makes the
# proportional plan uneven on purpose: rank 0 ("small") runs 2 of the 8 layers, rank 1 ("big") runs 6.
[cluster]
name = "demo"

[[node]]
name = "small"
local = true
memory_gb = 2
runtime_dir = "{run}/small"

[[node]]
name = "big"
local = true
memory_gb = 6
runtime_dir = "{run}/big"
"""


class DemoFailed(ClusterctlError):
    exit_code = Exit.FAILED


@dataclass
class DemoResult:
    deployment_id: str = ""
    job_id: str = ""
    endpoint: str = ""
    answer: str = ""
    completion_tokens: int = 0
    seconds: float = 0.0
    ranks: list[dict] = field(default_factory=list)
    teardown_ok: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"deployment_id": self.deployment_id, "job_id": self.job_id, "endpoint": self.endpoint,
                "answer": self.answer, "completion_tokens": self.completion_tokens,
                "tokens_per_second": round(self.tokens_per_second, 2), "ranks": self.ranks,
                "teardown_ok": self.teardown_ok}


def stream_chat(endpoint: str, prompt: str, *, max_tokens: int, on_text=lambda s: None,
                api_key: str | None = None, timeout: float = 120, model: str | None = "default"
                ) -> tuple[str, int, float]:
    """POST a streaming chat completion and read its server-sent events; returns (text, tokens, seconds).
    ``model`` None leaves the field out (mlx_lm.server then serves its --model instead of loading that name)."""
    doc = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
           "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
    if model is None:
        del doc["model"]
    body = json.dumps(doc).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(endpoint.rstrip("/") + "/v1/chat/completions", data=body, headers=headers)
    text, tokens, chunks = [], 0, 0
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            doc = json.loads(data)
            if doc.get("usage"):
                tokens = doc["usage"].get("completion_tokens", tokens)
            for ch in doc.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    chunks += 1
                    text.append(piece)
                    on_text(piece)
    return "".join(text), tokens or chunks, time.monotonic() - t0


async def run_demo(state, workdir: Path, *, prompt: str, max_tokens: int, out) -> DemoResult:
    from clusterctl.launch.status import status
    from clusterctl.launch.supervisor import LaunchOptions, launch
    from clusterctl.plan.commands import plan_command
    from clusterctl.tinymodel import build

    res = DemoResult()
    workdir.mkdir(parents=True, exist_ok=True)
    out.info(f"1/6 building (or reusing) the tiny model in {workdir / 'tiny'}")
    model = await asyncio.to_thread(build, workdir / "tiny")
    cluster = workdir / "cluster.toml"
    cluster.write_text(DEMO_CLUSTER.format(run=workdir / "run"))
    out.info("2/6 planning: 2 local nodes, proportional allocation")
    dep, _ = plan_command(cluster, Path(model), out=workdir / "deployment.json", state=state,
                          allocation="proportional", backend="auto", parallel="pipeline", context=2048, batch=1,
                          headroom_gb=0.5)
    res.deployment_id = dep.deployment_id
    from clusterctl.render import deployment_table

    out.table(deployment_table(dep))
    out.info("3/6 launching: one rank per node, gate, canary")
    running = await launch(str(workdir / "deployment.json"), state, LaunchOptions(timeout=300, grace=10),
                           log=out.info)
    res.job_id, res.endpoint = running.manifest.job_id, running.endpoint or ""
    try:
        out.info(f"4/6 chat request to {res.endpoint} (streamed)")
        res.answer, res.completion_tokens, res.seconds = await asyncio.to_thread(
            stream_chat, res.endpoint, prompt, max_tokens=max_tokens, on_text=out.stream)
        out.stream("\n")
        if res.completion_tokens < 1:
            raise DemoFailed("the chat request produced no tokens")
        out.info("5/6 status")
        doc = await status(state, running.opts.ssh)
        job = next(j for j in doc["jobs"] if j["job_id"] == res.job_id)
        from clusterctl.render import status_table

        out.table(status_table(job))
        peaks = {}
        for r in running.manifest.ranks:
            m = await running.hs[r.node].read_json(r.marker_path) or {}
            peaks[r.rank] = m.get("peak_rss_bytes")
        res.ranks = [{"rank": r.rank, "node": r.node, "layers": r.end_layer - r.start_layer,
                      "range": [r.start_layer, r.end_layer], "pid": r.pid, "peak_rss_bytes": peaks.get(r.rank)}
                     for r in running.manifest.ranks]
    finally:
        out.info("6/6 verified teardown")
        report = await running.teardown()
        res.teardown_ok = report.ok
    if not report.ok:
        raise DemoFailed("teardown could not confirm: " + "; ".join(report.survivors()))
    return res
