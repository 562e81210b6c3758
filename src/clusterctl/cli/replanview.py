"""What `clusterctl replan` reads and shows around its core call (launch/replan.py): its own flags, the options
it was given, the preview, the "unchanged" note and the confirmation."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from clusterctl.cli.options import number
from clusterctl.errors import UsageError

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
    if not (p.diff["unchanged"] and not p.diff["records_changed"]):
        return False
    if o.json:
        o.data({**doc, "action": "unchanged"})
    o.info(f"unchanged: deployment {p.old.deployment_id} already has these options; nothing to do")
    return True


def preview(o, p) -> None:
    """The replan preview: stderr, like plan's table (stdout is data)."""
    from clusterctl.plan.replan import diff_lines

    for k, v in p.inputs.get("given", {}).items():
        o.info(f"given    {k}: {v}")
    for k, v in p.inputs.get("derived", {}).items():
        o.info(f"derived  {k}: {v}")
    o.info(f"deployment {p.old.deployment_id} -> {p.new.deployment_id}"
           + (f" (job {', '.join(m.job_id for m in p.jobs)} running)" if p.jobs else " (not running)"))
    for line in diff_lines(p.diff):
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
