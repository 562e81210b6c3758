"""What every command shares: the Typer app, the options defined once, the helpers that turn flags into the
core's arguments, and the error edge (an expected failure is one line, a JSON document with --json, an exit code).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from clusterctl import __version__
from clusterctl.errors import ClusterctlError, Exit, UsageError
from clusterctl.render import Output
from clusterctl.atomic import read_capped


def report_error(o: Output, e: ClusterctlError, *, hint: bool = True) -> int:
    """Say a failure: the JSON error document with --json, one line on stderr (and its hint); its exit code."""
    if o.json:
        o.data({"ok": False, **e.to_json()})
    # "lock held" is routine for cron: with --quiet it only shows in the exit code (75)
    if not (o.quiet and e.exit_code == Exit.TEMPFAIL):
        print(f"error: {e.message}", file=sys.stderr)
        if hint and e.hint and not o.quiet:
            print(f"hint: {e.hint}", file=sys.stderr)
    return int(e.exit_code)


def os_error(e: OSError) -> ClusterctlError:
    """A path the filesystem refuses where no command expected it (a name over 255 bytes, a path through a
    file): the operator's input, said in one line, not an internal error."""
    import errno

    where = f": {e.filename}" if e.filename else ""
    code = Exit.CANTCREAT if e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT) else Exit.NOINPUT
    return ClusterctlError(f"{e.strerror or type(e).__name__}{where}", exit_code=code)


class Group(TyperGroup):
    """Typer's group with clusterctl's error edge, so ``main()`` and ``typer.testing.CliRunner`` see the same
    exit codes, stdout and stderr."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ClusterctlError as e:
            raise typer.Exit(report_error(output_of(ctx), e)) from None
        except OSError as e:
            raise typer.Exit(report_error(output_of(ctx), os_error(e), hint=False)) from None


app = typer.Typer(
    name="clusterctl",
    help="Serve one LLM across several machines with MLX distributed ranks.\n\n"
         "Plan a placement, launch one rank per node, tear it down verified.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=Group,
)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True, cls=Group)
app.add_typer(model_app, name="model")

# ---- options shared by every command, defined once --------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else on stdout).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")]
StateOpt = Annotated[Optional[Path], typer.Option(
    "--state-dir", envvar="CLUSTERCTL_STATE_DIR", help="Where keys, deployments and launch manifests live.",
    show_default="the user state dir")]
ClusterOpt = Annotated[Path, typer.Option(
    "--cluster", "-c", envvar="CLUSTERCTL_CLUSTER", help="The cluster inventory (cluster.toml).")]


def number(lo: float, hi: float):
    """A parser of a float flag: finite and within [lo, hi] when the command line is parsed (exit 2), so that
    'inf', 'nan' or 1e309 never reach the code that sleeps, multiplies or converts to an integer."""
    def parse(value) -> float:
        import math

        try:
            x = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{str(value)[:40]!r} is not a number") from None
        if not (math.isfinite(x) and lo <= x <= hi):
            raise typer.BadParameter(f"{str(value)[:40]} is not a number in [{lo:g}, {hi:g}]")
        return x
    return parse


def bind_host(value: str) -> str:
    """--host: an IP address or a host name to bind, checked when the command line is parsed."""
    from clusterctl.front.apikey import check_bind_host

    try:
        return check_bind_host(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def output(ctx: typer.Context, json: bool, quiet: bool) -> Output:
    """This call's output (made by the root callback, or given by ``main`` or a test), set to the flags."""
    o = output_of(ctx)
    o.json, o.quiet = json, quiet
    return o


def output_of(ctx: typer.Context) -> Output:
    root = ctx.find_root()
    if root.obj is None:
        root.obj = Output()
    return root.obj


def state_of(state_dir: Path | None):
    from clusterctl.statedir.state import StateDir

    return StateDir(state_dir).check_safe()


ENV_LEASE = "CLUSTERCTL_LAUNCHER_LEASE"


def lease_from_env() -> float:
    """The launcher lease from env CLUSTERCTL_LAUNCHER_LEASE (unset or empty: the default), checked like --lease:
    read here, at the edge, for every command that launches (launch, replan, supervise, demo)."""
    import math

    from clusterctl.launch.jobplan import DEFAULT_LEASE

    text = os.environ.get(ENV_LEASE, "").strip()
    if not text:
        return DEFAULT_LEASE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1 <= value <= 3600):
        raise UsageError(f"{ENV_LEASE}={text[:40]!r} is not a number of seconds in [1, 3600]")
    return value


# rank 0's defaults for what a request leaves out (plan and replan; docs/api.md)
# plan/replan --kv-bits: the KV cache stored quantized (plan/kvquant.py); the values are checked by PlanOptions
KvBitsOpt = Annotated[Optional[int], typer.Option(
    "--kv-bits", help="Store the KV cache quantized to 4 or 8 bits (mlx-lm's QuantizedKVCache): longer contexts "
    "fit, attention is slightly less exact. Replan: 0 turns it off.", min=0, max=64, metavar="4|8")]
KvGroupSizeOpt = Annotated[Optional[int], typer.Option(
    "--kv-group-size", help="With --kv-bits: numbers per quantization scale and bias, 32 | 64 | 128 (default 64).",
    min=1, max=1 << 16, metavar="G")]
QuantizedKvStartOpt = Annotated[Optional[int], typer.Option(
    "--quantized-kv-start", help="With --kv-bits: a sequence's cache is quantized once it holds this many tokens "
    "(default 5000, mlx-lm's).", min=0, max=1 << 26, metavar="T")]


def kv_options(kv_bits: int | None, kv_group_size: int | None, quantized_kv_start: int | None, *,
               replan: bool = False) -> dict:
    """The --kv-* flags given, as PlanOptions fields (replan: only those given; --kv-bits 0 turns it off)."""
    if not replan and kv_bits is None and (kv_group_size is not None or quantized_kv_start is not None):
        raise UsageError("--kv-group-size and --quantized-kv-start need --kv-bits 4 or 8")
    out = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start}
    out = {k: v for k, v in out.items() if v is not None}
    if replan and out.get("kv_bits") == 0:
        out["kv_bits"] = None
    return out


TemperatureOpt = Annotated[Optional[float], typer.Option(
    "--temperature", help="Default sampling temperature (OpenAI's: 1).", parser=number(0, 2), metavar="T")]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="Default top_p.", parser=number(0, 1), metavar="P")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="Default top_k (0: none).", min=0, max=1 << 20)]
MinPOpt = Annotated[Optional[float], typer.Option("--min-p", help="Default min_p.", parser=number(0, 1), metavar="P")]
MaxTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-tokens", help="Default max_tokens (OpenAI's: until the request's context is full).", min=1, max=1 << 26)]
MaxNOpt = Annotated[Optional[int], typer.Option(
    "--max-n", help="The most choices (n) one request may ask for (default 8).", min=1, max=128)]
ChatTemplateOpt = Annotated[Optional[Path], typer.Option(
    "--chat-template", help="A Jinja chat template file used in place of the model's.", metavar="FILE")]
ChatTemplateArgsOpt = Annotated[Optional[str], typer.Option(
    "--chat-template-args", help='JSON object passed to every chat template rendering, e.g. \'{"enable_thinking": false}\'.',
    metavar="JSON")]


def serving_of(temperature=None, top_p=None, top_k=None, min_p=None, max_tokens=None, chat_template=None,
               chat_template_args=None, max_n=None) -> dict:
    """The serving defaults given on the command line (only those given)."""
    import json as _json

    out = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                             ("max_tokens", max_tokens), ("max_n", max_n)) if v is not None}
    if chat_template is not None:
        try:
            out["chat_template"] = read_capped(chat_template, limit=65536, what="chat template").decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--chat-template {chat_template}: not UTF-8 text") from None
    if chat_template_args is not None:
        try:
            args = _json.loads(chat_template_args)
        except ValueError as e:
            raise UsageError(f"--chat-template-args: not JSON ({e})") from None
        if not isinstance(args, dict):
            raise UsageError("--chat-template-args: want a JSON object")
        out["chat_template_args"] = args
    if "chat_template" in out:
        from clusterctl.gguf.check import check_template

        check_template(out["chat_template"], f"--chat-template {chat_template}", out.get("chat_template_args"))
    return out


def _origin(value: str) -> str:
    """A browser origin (scheme://host[:port], no path) or "*"."""
    import re

    if value == "*" or re.fullmatch(r"https?://[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?",
                                    value):
        return value
    raise typer.BadParameter(f"{value[:60]!r} is not an origin (scheme://host[:port], or *)")


def _alias(value: str) -> str:
    from clusterctl.names import NAME_RE

    if NAME_RE.match(value):
        return value
    raise typer.BadParameter(f"{value[:60]!r} is not a model name (letters, digits, . _ -, at most 63)")


CorsOpt = Annotated[Optional[list[str]], typer.Option(
    "--cors-origin", help="A browser origin allowed to call the API (repeatable; * for any). Without it: no CORS.",
    parser=_origin, metavar="ORIGIN")]
AliasOpt = Annotated[Optional[list[str]], typer.Option(
    "--model-alias", help="Another name clients may give as `model` (repeatable).", parser=_alias, metavar="NAME")]


def api_key_of(env_name: str | None, no_key: bool) -> str | None:
    from clusterctl.front.apikey import api_key_from_env

    return api_key_from_env(env_name, no_key=no_key)


def api_keys_of(path: Path | None, default_key: str | None, no_key: bool) -> dict[str, str]:
    from clusterctl.front.apikey import api_keys_from_file

    if path is not None and no_key:
        raise UsageError("--api-keys-file and --no-api-key contradict each other: give one")
    return api_keys_from_file(str(path) if path is not None else None, default_key=default_key)


def complete_targets(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of what names a deployment: deployment and job ids of the state dir, and deployment
    files (``*.json``) and folders under the word typed so far. Reads file names only; never fails."""
    import glob

    from clusterctl.statedir.state import StateDir

    out: set[str] = set()
    try:
        st = StateDir((ctx.params or {}).get("state_dir") or os.environ.get("CLUSTERCTL_STATE_DIR") or None)
        for folder in (st.deployments, st.launches):
            if folder.is_dir():
                out.update(p.stem for p in folder.glob("*.json"))
        for p in glob.glob(glob.escape(incomplete) + "*"):
            if os.path.isdir(p):
                out.add(p.rstrip("/") + "/")
            elif p.endswith(".json"):
                out.add(p)
    except Exception:
        pass
    return sorted(x for x in out if x.startswith(incomplete))


def _version(value: bool) -> None:
    if value:
        print(f"clusterctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(ctx: typer.Context,
          version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False) -> None:
    output_of(ctx)  # one Output per call, shared by the command and the error edge



GraceOpt = Annotated[float, typer.Option("--grace", help="Seconds between SIGTERM and SIGKILL.", parser=number(0, 3600),
                                         metavar="SECONDS")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds to wait for every rank to be ready.",
                                           parser=number(1, 7 * 86400), metavar="SECONDS")]
DrainOpt = Annotated[float, typer.Option("--drain", help="Wait up to S seconds for requests in flight to finish first.",
                                         parser=number(0, 86400), metavar="SECONDS")]
HostOpt = Annotated[Optional[str], typer.Option("--host", help="Address rank 0's HTTP API binds (an IP address or host name).",
                                                callback=lambda v: None if v is None else bind_host(v),
                                                show_default="127.0.0.1; replan: the old job's")]
PortOpt = Annotated[Optional[int], typer.Option("--port", help="Rank 0's HTTP port (default: a fresh one).", min=1, max=65535)]
ApiKeyEnvOpt = Annotated[Optional[str], typer.Option(
    "--api-key-env", help="Name of the env var holding the API key (never on argv); it must be set and not empty.",
    show_default="CLUSTERCTL_API_KEY, when set")]
ApiKeysFileOpt = Annotated[Optional[Path], typer.Option(
    "--api-keys-file", help="More API keys, one tenant per line: NAME KEY (the file readable by you alone). Each "
                            "tenant has its own prompt-cache partition (docs/security.md).", metavar="FILE")]
NoApiKeyOpt = Annotated[bool, typer.Option(
    "--no-api-key", help="Serve without an API key even when rank 0 listens beyond loopback (anyone who reaches "
                         "the port can use the model).")]
SeedOpt = Annotated[int, typer.Option(help="Sampling seed shared by all ranks.", min=0, max=2**31 - 1)]
MaxQueueOpt = Annotated[int, typer.Option("--max-queue", help="Requests held waiting for a batch slot; beyond them rank 0 answers 429 with Retry-After.", min=0, max=65536)]
MAX_CONTEXT = 1 << 24  # tokens per sequence
MAX_BATCH = 1024  # batch slots (a rank contract's bound)
KnownHostsOpt = Annotated[Optional[Path], typer.Option("--known-hosts", help="known_hosts file for SSH nodes.",
                                                       show_default="~/.ssh/known_hosts")]
AcceptNewOpt = Annotated[bool, typer.Option("--accept-new-host-keys",
                                            help="Trust an SSH host key seen for the first time (a changed key is still refused).")]


def ssh_options(known_hosts: Path | None, accept_new: bool):
    from clusterctl.connect.nodes import Connector

    return Connector(known_hosts=known_hosts, accept_new_host_keys=accept_new)




def front_address(value: str) -> str:
    """--front HOST:PORT, checked when the command line is parsed (exit 2); the value stays the text given."""
    from clusterctl.front.records import parse_front

    try:
        parse_front(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


FrontOpt = Annotated[Optional[str], typer.Option(
    "--front", help="Also serve the API at this stable HOST:PORT (the front door: it follows the cluster's current "
                    "job across replans and heals; started detached unless one serves there already; docs/front.md).",
    callback=lambda v: None if v is None else front_address(v), metavar="HOST:PORT")]


# the supervisor's policy (launch --heal, supervise; supervise/policy.py, docs/heal.md); None: the policy's default
HealGraceOpt = Annotated[Optional[float], typer.Option(
    "--heal-grace", help="Seconds a rank or node must stay down before it is healed (default 5).",
    parser=number(0, 3600), metavar="SECONDS")]
HealMaxOpt = Annotated[Optional[int], typer.Option(
    "--heal-max", help="At most this many heals and rejoins per --heal-window (default 3).", min=1, max=1000)]
HealWindowOpt = Annotated[Optional[float], typer.Option(
    "--heal-window", help="The window of --heal-max, in seconds (default 600).", parser=number(1, 7 * 86400),
    metavar="SECONDS")]
HealBackoffOpt = Annotated[Optional[float], typer.Option(
    "--heal-backoff", help="Seconds after a heal before the next one; doubles with each heal in the window "
                           "(default 10; at most 300 s, or this).", parser=number(0, 86400), metavar="SECONDS")]
RejoinAfterOpt = Annotated[Optional[float], typer.Option(
    "--rejoin-after", help="Seconds a lost node must answer and pass the probe before the original plan comes "
                           "back (default 15).", parser=number(0, 86400), metavar="SECONDS")]
RejoinDrainOpt = Annotated[Optional[float], typer.Option(
    "--rejoin-drain", help="Seconds the rejoin waits for a moment with no request in flight before it goes ahead "
                           "anyway (default 10).", parser=number(0, 86400), metavar="SECONDS")]


@dataclass(frozen=True)
class HealFlags:
    """The supervisor's policy flags (launch --heal, supervise), taken as one (cli/flaggroups.py)."""

    heal_grace: HealGraceOpt = None
    heal_max: HealMaxOpt = None
    heal_window: HealWindowOpt = None
    heal_backoff: HealBackoffOpt = None
    rejoin_after: RejoinAfterOpt = None
    rejoin_drain: RejoinDrainOpt = None

    def policy(self):
        """The policy from the flags given (None: supervise/policy.py's default)."""
        from clusterctl.supervise.policy import HealPolicy

        given = {k: v for k, v in (("grace_s", self.heal_grace), ("max_heals", self.heal_max),
                                   ("window_s", self.heal_window), ("backoff_s", self.heal_backoff),
                                   ("rejoin_after_s", self.rejoin_after), ("drain_s", self.rejoin_drain))
                 if v is not None}
        if self.heal_backoff is not None:
            given["backoff_max_s"] = max(HealPolicy.backoff_max_s, self.heal_backoff)
        return HealPolicy(**given)
