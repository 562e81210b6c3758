"""The clusterctl command line: parse flags, call one core function, render. No logic lives here.

Exit codes are API (docs/cli.md). Every expected failure is a ClusterctlError, printed as one line.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from clusterctl import __version__
from clusterctl.errors import ClusterctlError, Exit
from clusterctl.render import Output

app = typer.Typer(
    name="clusterctl",
    help="Serve one LLM across several machines with MLX distributed ranks.\n\n"
         "Plan a placement, sync the model, launch one rank per node, tear it down verified.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")

OUT = Output()

# ---- options shared by every command, defined once --------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else on stdout).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")]
StateOpt = Annotated[Optional[Path], typer.Option(
    "--state-dir", envvar="CLUSTERCTL_STATE_DIR", help="Where keys, deployments and launch manifests live.",
    show_default="the user state dir")]
ClusterOpt = Annotated[Path, typer.Option(
    "--cluster", "-c", envvar="CLUSTERCTL_CLUSTER", help="The cluster inventory (cluster.toml).")]


def _out(json: bool, quiet: bool) -> Output:
    OUT.json, OUT.quiet = json, quiet
    return OUT


def _state(state_dir: Path | None):
    from clusterctl.state import StateDir

    return StateDir(state_dir)


def _version(value: bool) -> None:
    if value:
        print(f"clusterctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False) -> None:
    pass


# ---- plan ---------------------------------------------------------------------------------------------------------
@app.command()
def plan(
    cluster: ClusterOpt,
    model: Annotated[Path, typer.Option("--model", "-m", help="The model folder on this machine (config.json + safetensors).")],
    allocation: Annotated[str, typer.Option(help="balanced | proportional (RAM-weighted) | speed (measured speed).")] = "balanced",
    backend: Annotated[str, typer.Option(help="auto | ring | jaccl | mpi.")] = "auto",
    parallel: Annotated[str, typer.Option(help="pipeline | tensor.")] = "pipeline",
    context: Annotated[int, typer.Option(help="KV cache budget: tokens per sequence.", min=1)] = 4096,
    batch: Annotated[int, typer.Option(help="KV cache budget: concurrent sequences.", min=1)] = 1,
    headroom_gb: Annotated[float, typer.Option("--headroom-gb", help="Per-rank headroom (GiB) for runtime memory.", min=0)] = 0.5,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the signed deployment here.")] = None,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Split the model's layers across the nodes, check the fit, and write a signed deployment file."""
    o = _out(json, quiet)
    from clusterctl.plan.commands import plan_command

    dep, written = plan_command(cluster, model, allocation=allocation, backend=backend, parallel=parallel,
                                context=context, batch=batch, headroom_gb=headroom_gb, out=out, state=_state(state_dir))
    for w in dep.warnings:
        o.warn(w)
    if o.json:
        o.data(dep.model_dump(mode="json"))
        return
    from clusterctl.render import deployment_table

    o.table(deployment_table(dep))
    o.info(f"wrote {', '.join(str(p) for p in written)}")


# ---- verify -------------------------------------------------------------------------------------------------------
@app.command()
def verify(
    file: Annotated[str, typer.Argument(help="A deployment file, or a deployment id in the state dir.")],
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a deployment file's signature and schema (exit 65 when it is tampered with or unsigned)."""
    o = _out(json, quiet)
    path, loaded = _state(state_dir).load_deployment(file)
    dep = loaded.deployment
    doc = {"ok": True, "file": str(path), "deployment_id": dep.deployment_id, "plan_hash": dep.plan_hash,
           "placement": dep.placement, "migrated_from": loaded.migrated_from}
    if o.json:
        o.data(doc)
    else:
        if loaded.migrated_from:
            o.info(f"migrated {path} from schema version {loaded.migrated_from} to {dep.schema_version}")
        o.info(f"ok: {path}: deployment {dep.deployment_id}, placement {dep.placement}, signature valid")


# ---- entry --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    # Standalone mode lets Typer handle usage errors (exit 2) and --help; ours are mapped here.
    try:
        app(args=argv, prog_name="clusterctl")
    except ClusterctlError as e:
        _fail(e)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        # An internal error: the only case with a traceback, and never with local variables.
        traceback.print_exc(file=sys.stderr)
        print(f"error: internal error ({type(e).__name__}); please report it", file=sys.stderr)
        sys.exit(int(Exit.SOFTWARE))


def _fail(e: ClusterctlError) -> None:
    if OUT.json:
        OUT.data({"ok": False, **e.to_json()})
    print(f"error: {e.message}", file=sys.stderr)
    if e.hint and not OUT.quiet:
        print(f"hint: {e.hint}", file=sys.stderr)
    sys.exit(int(e.exit_code))


if __name__ == "__main__":  # pragma: no cover
    main()
