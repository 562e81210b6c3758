"""The clusterctl command line: parse flags, call one core function, render. No logic lives here.

Exit codes are API (docs/cli.md). Every expected failure is a ClusterctlError, printed as one line. Each call gets
its own ``render.Output`` (``ctx.obj``): ``main`` makes it, a test may pass one to ``typer.testing.CliRunner``.
The commands live in ``plancmds``, ``jobcmds``, ``modelcmds``, ``frontcmds`` and ``supervisecmds``; what they share
in ``options``; flags taken as one typed value (``LaunchFlags``, ``HealFlags``, ``PlanFlags``) by ``flaggroups``.
"""

from __future__ import annotations

import sys
import traceback

import typer

from clusterctl.cli import jobcmds, modelcmds, plancmds, supervisecmds  # noqa: F401  (registers them, in this order)
from clusterctl.cli.options import app, model_app, os_error, report_error  # noqa: F401
from clusterctl.errors import ClusterctlError, Exit, UsageError
from clusterctl.render import Output
from clusterctl.hardexit import exit_now


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if "mlx.core" in sys.modules and argv is None:
            # A command that loaded mlx (demo, model tiny) ends without the interpreter's teardown: mlx's native
            # worker threads made it abort at exit ("terminate called without an active exception", SIGABRT)
            # in 2 of 20 demo runs here, after all the work was done and reported.
            exit_now(code)
        raise


def _main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from clusterctl.connect.fdlimit import raise_nofile

    raise_nofile()  # one connection per node: a shell's soft limit (256 on macOS) is too low for big clusters
    # set from argv too, so that even a usage error gives a JSON document when one was asked for
    out = Output(json="--json" in args, quiet="-q" in args or "--quiet" in args)
    try:
        rc = app(args=args, prog_name="clusterctl", standalone_mode=False, obj=out)
    except ClusterctlError as e:
        sys.exit(report_error(out, e))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        sys.exit(report_error(out, os_error(e), hint=False))
    except Exception as e:
        sys.exit(_unexpected(out, e))
    sys.exit(rc if isinstance(rc, int) else 0)


def _unexpected(out: Output, e: Exception) -> int:
    if type(e).__name__ == "NoArgsIsHelpError":  # Typer's own Click: no public name to catch it by
        return int(Exit.USAGE)  # the help was printed; no empty "error:" line after it
    if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
        # Typer's usage errors (unknown flag, bad value): one line, exit 2, like every other error
        import re

        ctx = getattr(e, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        msg = re.sub(r" \(Possible options: [^)]*\)", "", e.format_message().replace("\n", " "))
        return report_error(out, UsageError(msg + where), hint=False)
    # An internal error: the only case with a traceback, and never with local variables.
    traceback.print_exc(file=sys.stderr)
    if out.json:
        out.data({"ok": False, "error": f"internal error ({type(e).__name__})", "exit_code": int(Exit.SOFTWARE),
                  "kind": "InternalError"})
    print(f"error: internal error ({type(e).__name__}); please report it", file=sys.stderr)
    return int(Exit.SOFTWARE)


if __name__ == "__main__":  # pragma: no cover
    main()
