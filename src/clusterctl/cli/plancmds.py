"""plan and verify: the signed deployment file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from clusterctl.cli.options import (MAX_BATCH, MAX_CONTEXT, ChatTemplateArgsOpt, ChatTemplateOpt, ClusterOpt,
                                    JsonOpt, KvBitsOpt, KvGroupSizeOpt, MaxNOpt, MaxTokensOpt, MinPOpt,
                                    QuantizedKvStartOpt, QuietOpt, StateOpt, TemperatureOpt, TopKOpt, TopPOpt, app,
                                    complete_targets, kv_options, number, output, serving_of, ssh_options, state_of)
from clusterctl.render import deployment_table


# ---- plan ---------------------------------------------------------------------------------------------------------
@app.command()
def plan(
    ctx: typer.Context,
    cluster: ClusterOpt,
    model: Annotated[str, typer.Option("--model", "-m", help="The model folder on this machine (config.json + "
                                       "safetensors), or a hub name ORG/NAME[@REVISION] (downloaded into the hub "
                                       "cache; an existing folder of that name wins).")],
    allocation: Annotated[str, typer.Option(help="auto | balanced | proportional (RAM-weighted) | speed (measured "
                                                 "speed) | work (the slowest stage as fast as it can be; auto: work "
                                                 "when the stages overlap, else balanced).")] = "auto",
    backend: Annotated[str, typer.Option(help="auto | ring | jaccl | mpi.")] = "auto",
    parallel: Annotated[str, typer.Option(help="auto | pipeline | tensor (auto: tensor when every pair of nodes "
                                               "has a declared fast link and the model shards evenly).")] = "auto",
    context: Annotated[int, typer.Option(help="KV cache budget: tokens per sequence.", min=1, max=MAX_CONTEXT)] = 4096,
    batch: Annotated[Optional[int], typer.Option(
        help="Batch slots: requests decoded together, each with a KV cache of --context tokens "
             "(default: as many as fit, up to 8; a number that does not fit is refused).", min=1, max=MAX_BATCH)] = None,
    headroom_gb: Annotated[float, typer.Option("--headroom-gb", help="Per-rank headroom (GiB) for runtime memory.",
                                               parser=number(0, 1e6), metavar="GIB")] = 0.5,
    embedding_offload: Annotated[str, typer.Option("--embedding-offload",
                                                   help="off | on | auto: serve the token embedding from SSD (auto: only when it would not fit).")] = "off",
    schedule: Annotated[str, typer.Option(help="auto | overlap | lockstep: how a pipeline decodes (overlap: a "
                                               "micro-batch per stage in flight; auto: overlap where it can).")] = "auto",
    prompt_cache_gb: Annotated[float, typer.Option("--prompt-cache-gb", help="Per-rank memory (GiB) kept for the "
                                                   "prompt cache (0: none).", parser=number(0, 1e6),
                                                   metavar="GIB")] = 0.25,
    adapter: Annotated[Optional[Path], typer.Option("--adapter", help="A LoRA adapter folder (mlx_lm.lora's "
                                                    "output) every rank applies to its layers.")] = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    quantized_kv_start: QuantizedKvStartOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_n: MaxNOpt = None,
    chat_template: ChatTemplateOpt = None,
    chat_template_args: ChatTemplateArgsOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the signed deployment here.")] = None,
    probe: Annotated[bool, typer.Option("--probe", help="Read memory_gb of remote nodes that lack it over SSH.")] = False,
    known_hosts: Annotated[Optional[Path], typer.Option("--known-hosts", help="known_hosts file for --probe.")] = None,
    accept_new_host_keys: Annotated[bool, typer.Option("--accept-new-host-keys", help="With --probe: trust a new host key once.")] = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Split the model's layers across the nodes, check the fit, and write a signed deployment file."""
    o = output(ctx, json, quiet)
    from clusterctl.launch.plannedmodel import plan_and_record

    probe_remote = None
    if probe:
        from clusterctl.connect.nodes import probe_memory

        def probe_remote(nodes):
            return probe_memory(nodes, ssh_options(known_hosts, accept_new_host_keys))

    dep, written = plan_and_record(cluster, model, allocation=allocation, backend=backend, parallel=parallel,
                                context=context, batch=batch, headroom_gb=headroom_gb, out=out, state=state_of(state_dir),
                                probe_remote=probe_remote, embedding_offload=embedding_offload, schedule=schedule,
                                 prompt_cache_gb=prompt_cache_gb, progress=o.progress, adapter=adapter,
                                **kv_options(kv_bits, kv_group_size, quantized_kv_start),
                                serving=serving_of(temperature, top_p, top_k, min_p, max_tokens, chat_template,
                                                   chat_template_args, max_n) or None)
    for w in dep.warnings:
        o.warn(w)
    if o.json:
        o.data(dep.model_dump(mode="json"))
        return
    o.table(deployment_table(dep))
    if dep.parallel_reason:
        o.info(f"parallel {dep.parallel_reason}")
    if dep.schedule_reason:
        o.info(f"schedule {dep.schedule}: {dep.schedule_reason}")
    if dep.allocation_reason:
        o.info(f"allocation {dep.allocation}: {dep.allocation_reason}")
    o.info(f"wrote {', '.join(str(p) for p in written)}")


# ---- verify -------------------------------------------------------------------------------------------------------
@app.command()
def verify(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="A deployment file, or a deployment id in the state dir.",
                                        autocompletion=complete_targets)],
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a deployment file's signature and schema (exit 65 when it is tampered with or unsigned)."""
    o = output(ctx, json, quiet)
    path, loaded = state_of(state_dir).load_deployment(file)
    dep = loaded.deployment
    doc = {"ok": True, "file": str(path), "deployment_id": dep.deployment_id, "plan_hash": dep.plan_hash,
           "placement": dep.placement, "migrated_from": loaded.migrated_from}
    if o.json:
        o.data(doc)
    else:
        if loaded.migrated_from:
            o.info(f"migrated {path} from schema version {loaded.migrated_from} to {dep.schema_version}")
        o.info(f"ok: {path}: deployment {dep.deployment_id}, placement {dep.placement}, signature valid")
