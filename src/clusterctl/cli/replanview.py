"""What `clusterctl replan` reads and shows around its core calls (launch/replan.py): its own flags (PlanFlags: the
new plan's), the request they make (ReplanRequest: the new plan's flags, how the new job serves, how to apply), the options it was given,
the preview, the "unchanged" note, the confirmation, and the run from preview to relaunch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from clusterctl.cli.frontcmds import front_for
from clusterctl.cli.launchflags import LaunchFlags
from clusterctl.cli.options import (MAX_BATCH, MAX_CONTEXT, ChatTemplateArgsOpt, ChatTemplateOpt, KvBitsOpt,
                                    KvGroupSizeOpt, MaxTokensOpt, MinPOpt, QuantizedKvStartOpt, TemperatureOpt,
                                    TopKOpt, TopPOpt, kv_options, number, serving_of)
from clusterctl.errors import Exit, UsageError

if TYPE_CHECKING:
    from clusterctl.statedir.state import StateDir

# replan's own flags: each defaults to the current deployment's value
ReplanPromptCacheOpt = Annotated[Optional[float], typer.Option(
    "--prompt-cache-gb", help="Per-rank memory (GiB) kept for the prompt cache (0: none; default: the current "
                              "deployment's).", parser=number(0, 1e6), metavar="GIB")]
ReplanHeadroomOpt = Annotated[Optional[float], typer.Option(
    "--headroom-gb", help="Per-rank headroom (GiB) (default: the current deployment's).", parser=number(0, 1e6),
    metavar="GIB")]


def parse_path_map(text: str | None) -> dict[str, str] | None:
    """--path-map "a=/models/x,b=/models/y"; an empty string is an explicit empty map."""
    if text is None:
        return None
    out: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        node, eq, path = part.partition("=")
        if not eq or not node or not path.startswith("/"):
            raise UsageError(f"--path-map: {part!r} is not NODE=/absolute/path")
        if node in out:
            raise UsageError(f"--path-map: node {node} given twice")
        out[node] = path
    return out


def replan_given(serving: dict, kv: dict | None = None, **options) -> dict:
    """The options replan was given (the others come from the current deployment); ``serving`` is merged over
    the current deployment's defaults; ``kv``: the --kv-* flags given (options.kv_options: kv_bits None is off)."""
    given = {k: v for k, v in options.items() if v is not None} | (kv or {})
    if serving:
        given["serving"] = serving
    return given


def unchanged(o, p, doc: dict) -> bool:
    """The proposal changes nothing: say so (and, with --json, the document with action "unchanged")."""
    if not p.diff.nothing_to_do:
        return False
    if o.json:
        o.data({**doc, "action": "unchanged"})
    o.info(f"unchanged: deployment {p.old.deployment_id} already has these options; nothing to do")
    return True


def preview(o, p) -> None:
    """The replan preview: stderr, like plan's table (stdout is data)."""
    for k, v in p.inputs.get("given", {}).items():
        o.info(f"given    {k}: {v}")
    for k, v in p.inputs.get("derived", {}).items():
        o.info(f"derived  {k}: {v}")
    o.info(f"deployment {p.old.deployment_id} -> {p.new.deployment_id}"
           + (f" (job {', '.join(m.job_id for m in p.jobs)} running)" if p.jobs else " (not running)"))
    for line in p.diff.lines():
        o.info(line)


def confirmed(o, doc: dict) -> bool:
    """Asked on a terminal; anywhere else the preview is all (exit 3)."""
    if not sys.stdin.isatty():
        if o.json:
            o.data({**doc, "action": "previewed"})
        o.info("previewed only (not a terminal): run again with --yes to apply")
        return False
    if not typer.confirm("apply this replan?", default=False, err=True):
        if o.json:
            o.data({**doc, "action": "previewed"})
        return False
    return True


@dataclass(frozen=True)
class PlanFlags:
    """replan's flags for the new plan, as parsed (None: not given, the current deployment's), taken as one
    (cli/flaggroups.py)."""

    cluster: Annotated[Optional[Path], typer.Option("--cluster", "-c", help="A cluster.toml whose nodes replace the current ones (needed to add a node).")] = None
    nodes: Annotated[Optional[str], typer.Option("--nodes", help="Comma list of the nodes to plan on, in rank order.")] = None
    allocation: Annotated[Optional[str], typer.Option(help="auto | balanced | proportional | speed | work "
                                                           "(default: the current deployment's).")] = None
    backend: Annotated[Optional[str], typer.Option(help="auto | ring | jaccl | mpi.")] = None
    parallel: Annotated[Optional[str], typer.Option(help="auto | pipeline | tensor (default: the current deployment's).")] = None
    schedule: Annotated[Optional[str], typer.Option(help="auto | overlap | lockstep (default: the current deployment's).")] = None
    context: Annotated[Optional[int], typer.Option(help="KV cache budget: tokens per sequence.", min=1, max=MAX_CONTEXT)] = None
    batch: Annotated[Optional[int], typer.Option(help="Batch slots (default: the current deployment's).", min=1, max=MAX_BATCH)] = None
    prompt_cache_gb: ReplanPromptCacheOpt = None
    headroom_gb: ReplanHeadroomOpt = None
    kv_bits: KvBitsOpt = None
    kv_group_size: KvGroupSizeOpt = None
    quantized_kv_start: QuantizedKvStartOpt = None
    temperature: TemperatureOpt = None
    top_p: TopPOpt = None
    top_k: TopKOpt = None
    min_p: MinPOpt = None
    max_tokens: MaxTokensOpt = None
    chat_template: ChatTemplateOpt = None
    chat_template_args: ChatTemplateArgsOpt = None
    path_map: Annotated[Optional[str], typer.Option("--path-map", help='Per-node model paths "a=/m,b=/m" ("" = none: every node uses its model_path); each new path is checked on its node first.')] = None
    to: Annotated[Optional[str], typer.Option("--to", help="Go back to a previous deployment id (see `clusterctl history`).")] = None

    def change(self):
        """The plan change they ask for (launch/replan.PlanChange): the chat template read, every value checked."""
        from clusterctl.launch.replan import PlanChange

        given = replan_given(serving_of(self.temperature, self.top_p, self.top_k, self.min_p, self.max_tokens,
                                        self.chat_template, self.chat_template_args),
                             kv_options(self.kv_bits, self.kv_group_size, self.quantized_kv_start, replan=True),
                             allocation=self.allocation, backend=self.backend, parallel=self.parallel,
                             schedule=self.schedule, context=self.context, batch=self.batch,
                             prompt_cache_gb=self.prompt_cache_gb, headroom_gb=self.headroom_gb)
        nodes = [n.strip() for n in self.nodes.split(",") if n.strip()] if self.nodes is not None else None
        return PlanChange(cluster_file=self.cluster, nodes=nodes, options=given,
                          path_map=parse_path_map(self.path_map), to=self.to)


@dataclass(frozen=True)
class ReplanRequest:
    """`clusterctl replan` as given: the deployment, the new plan, how the new job serves, how to apply."""

    target: str | None
    plan: PlanFlags
    launch: LaunchFlags
    detach: bool | None = None  # the new job detached (True) or in the foreground (False); None: as the old one
    drain: float = 0.0
    yes: bool = False
    front: str | None = None


def run_replan(o, state: StateDir, req: ReplanRequest) -> int:
    """Propose, preview, check the new paths, confirm, then apply (launch/replan.py). Returns the exit code."""
    import asyncio

    from clusterctl.launch import replan as rp

    ssh = req.launch.ssh()
    p = rp.propose(state, req.target, req.plan.change())
    p.jobs = asyncio.run(rp.live_jobs_of(state, p, ssh))
    doc = p.to_json()
    preview(o, p)
    if unchanged(o, p, doc):
        return 0
    # a model folder the new deployment would be the first to use is checked on its node before anything stops
    doc["paths_checked"] = asyncio.run(rp.check_new_paths(state, p, ssh))
    if not req.yes and not confirmed(o, doc):
        return int(Exit.NOT_APPLIED)
    # everything the relaunch needs is settled before anything stops: a missing key ends the replan here
    host, port, was_detached = rp.relaunch_endpoint(p)
    opts = req.launch.options(detach=was_detached if req.detach is None else req.detach, default_host=host,
                              default_port=port)
    front_for(o, state, req.front, lambda: p.old.cluster, req.launch.known_hosts, req.launch.accept_new_host_keys)
    return rp.apply(state, p, opts, drain=req.drain, out=o, doc=doc)
