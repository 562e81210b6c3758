"""Fuzzing of the command line: every command, option and argument of ``clusterctl.cli.app``, found by
introspection (a new flag is fuzzed without a change here), with boundary numbers and hostile strings.

Each case runs ``clusterctl.cli.main(argv)`` in this process (stdout UTF-8 strict, stderr backslashreplace, like a
real process) with a temp state dir, a tiny local cluster and a tiny model, from a temp working folder. Commands
that would do real work end early: deployments and targets are names that do not exist (exit 66), and the cores
of ``launch``, ``model tiny`` and ``demo`` are replaced by stubs that stop with exit 66 once the CLI handed them
its values. The ``launch`` stub also checks what it was handed against the rank contract the values end up in
(``RankSpec``) and against what a socket can bind: a value the CLI lets through but a rank would refuse is found
here, not at launch time.

Properties, for every case (docs/cli.md):
- never exit 70 (internal error, traceback), nothing that fails to encode on stdout;
- an error is a line ``error: <something>`` on stderr (with ``(see ... --help)`` alone not counting as something);
- an argument longer than any path (4096 characters) is not echoed back whole: at most ~300 characters of it
  appear on stdout or stderr, and neither stream exceeds 64 KiB;
- with ``--json`` an error prints exactly one JSON document on stdout, ``ok: false`` and the exit code; without
  it, an error prints nothing on stdout (stdout carries data only);
- a numeric value that is not a number, not finite, beyond 64 bits, outside the declared range, or a port
  outside 0..65535 is a usage error (exit 2) before any work; so is a host that is neither an IP address nor a
  DNS name (options named ``host`` / ``*_host``);
- ``--help`` of every command is exit 0; a group alone (``clusterctl``, ``clusterctl model``) shows its help and
  no empty ``error:`` line, but a group with a default command (``clusterctl front``: its one-command form of
  before, which lists the fronts) does what that command does; an unknown command or option is a usage error
  that names it.
"""

from __future__ import annotations

import collections
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzutil import counting_fixtures, cli_problems as check
from fuzzutil import cache_typer_command, count, fuzz_settings, report_cases, run_cli, set_current

pytestmark = pytest.mark.slow  # every parameter of every command at its boundaries (minutes)

LONG = 1 << 20  # the "1 MB" argument

NUMERIC_EDGES = ["0", "-1", "1", str(10**19), str(-10**19), "inf", "-inf", "nan", "1e309", "", "x", "0x10", "1.5",
                 "-0", "65536", "70000", str(2**31), str(2**63), "1e18", " 7 ", "1_000"]
HOSTILE = ["", " ", "-", "-x", "--help", ".", "..", "../../x", "../../../escape", ";rm -rf clusterctl-fuzz",
           "$(id)", "a\nb", "\x1b[31mred\x1b[0m", "tab\there", "\x7f", "é日本🙂", "\udcff\udcfe-not-utf8",
           "y" * 300, "ab/" * 2731, "x" * LONG, "not an ip;rm"]  # 300: over NAME_MAX; 8 KiB: over PATH_MAX
# Never an absolute path: a value that names "/" would let `plan --state-dir /` write keys into the root.
assert not any(v.startswith("/") for v in NUMERIC_EDGES + HOSTILE)


# ---- introspection -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    command: tuple[str, ...]
    name: str
    opts: tuple[str, ...]  # empty for an argument
    kind: str  # int | float | flag | str | path | other
    required: bool
    multiple: bool
    lo: float | None
    hi: float | None
    envvars: tuple[str, ...]

    @property
    def is_argument(self) -> bool:
        return not self.opts

    @property
    def label(self) -> str:
        return self.opts[0] if self.opts else self.name.upper()


def _click_root():
    import typer

    from clusterctl import cli

    return typer.main.get_command(cli.app)


def _kind(p) -> str:
    ann = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    if ann is None:  # a plain click parameter
        name = getattr(getattr(p, "type", None), "name", "")
        return {"integer": "int", "integer range": "int", "float": "float", "float range": "float",
                "boolean": "flag", "path": "path", "text": "str"}.get(name, "other")
    import typing

    if typing.get_origin(ann) is list:
        ann = (typing.get_args(ann) or (str,))[0]
    if ann is bool:
        return "flag"
    if ann is int:
        return "int"
    if ann is float:
        return "float"
    if ann is str:
        return "str"
    if isinstance(ann, type) and issubclass(ann, Path):
        return "path"
    return "other"


def _bounds(p) -> tuple[float | None, float | None]:
    lo, hi = getattr(p, "min", None), getattr(p, "max", None)
    t = getattr(p, "type", None)
    if lo is None and hi is None and t is not None:
        lo, hi = getattr(t, "min", None), getattr(t, "max", None)
    return lo, hi


def commands() -> dict[tuple[str, ...], list[Param]]:
    """Every leaf command of the app (sub-apps walked), with its parameters."""
    out: dict[tuple[str, ...], list[Param]] = {}

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if isinstance(subs, dict) and subs:
            for name, sub in subs.items():
                walk(sub, path + (name,))
            return
        params = []
        for p in cmd.params:
            if getattr(p, "hidden", False) or p.name in ("help",):
                continue
            opts = () if getattr(p, "param_type_name", "") == "argument" or not any(
                o.startswith("-") for o in p.opts) else tuple(p.opts)
            env = p.envvar if isinstance(p.envvar, (list, tuple)) else ([p.envvar] if p.envvar else [])
            lo, hi = _bounds(p)
            params.append(Param(path, p.name, opts, _kind(p), bool(p.required), bool(p.multiple), lo, hi,
                                tuple(env)))
        out[path] = params

    walk(_click_root(), ())
    return out


def command_at(path: tuple[str, ...]):
    cmd = _click_root()
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def groups() -> list[tuple[str, ...]]:
    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if isinstance(subs, dict) and subs:
            out.append(path)
            for name, sub in subs.items():
                walk(sub, path + (name,))

    walk(_click_root(), ())
    return out


COMMANDS = commands()


# ---- expectations ----------------------------------------------------------------------------------------------

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def valid_host(v: str) -> bool:
    """An IP address (IPv6 with a zone id too) or an RFC 1123 DNS name."""
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        pass
    name = v[:-1] if v.endswith(".") else v
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def is_port(p: Param) -> bool:
    return p.name == "port" or p.name.endswith("_port")


def is_host(p: Param) -> bool:
    return p.name == "host" or p.name.endswith("_host")


def must_be_usage_error(p: Param, value: str) -> str | None:
    """Why ``value`` for ``p`` must be refused as a usage error (exit 2) at parse time, or None."""
    if p.kind in ("int", "float"):
        try:
            x = int(value) if p.kind == "int" else float(value)
        except ValueError:
            # Typer's (Click's) integers take a whole number written with a zero fraction ("1.0"), as Python's
            # int(float(...)) would, but no exponent or other fraction
            if p.kind != "int" or not re.fullmatch(r"\s*[+-]?[0-9_]+\.0*\s*", value):
                return "not a number"
            x = int(value.strip().split(".")[0])
        if isinstance(x, float) and not math.isfinite(x):
            return "not finite"
        if abs(x) >= 2**63:
            return "beyond 64 bits"
        if p.lo is not None and x < p.lo or p.hi is not None and x > p.hi:
            return f"outside the declared range [{p.lo}, {p.hi}]"
        if is_port(p) and not 0 <= x <= 65535:
            return "not a port (0..65535)"
    if is_host(p) and p.kind in ("str", "other") and not valid_host(value):
        return "neither an IP address nor a DNS name"
    return None


# ---- the world the commands run in -------------------------------------------------------------------------

@dataclass
class World:
    root: Path
    state: Path
    cwd: Path
    cluster: Path
    model: Path
    oracle: list[str] = field(default_factory=list)  # what the launch stub found wrong in the values it got

    def cwd_of(self, cmd: tuple[str, ...]) -> Path:
        """Each command's own working folder, four deep ("../../../x" stays inside the root): a file one command
        writes under a fuzzed name (plan --out) never becomes another command's deployment."""
        d = self.root / "cwd" / "-".join(cmd) / "w1" / "w2" / "w3"
        d.mkdir(parents=True, exist_ok=True)
        return d


def _check_launch_options(opts) -> list[str]:
    """What a rank would refuse among the values `launch` handed its core: the rank contract's own validation
    (RankSpec, as the launcher fills it for rank 0), and an HTTP address a socket can bind."""
    from clusterctl.errors import ClusterctlError
    from clusterctl.protocol.rankspec import parse_rank_spec

    bad = []
    spec = {"deployment_id": "d", "job_id": "j", "nonce": "n", "node": "a", "rank": 0, "world_size": 1,
            "model_path": "/m", "start_layer": 0, "end_layer": 1, "layer_counts": [1], "num_layers": 1,
            "http_host": opts.http_host, "http_port": opts.http_port if opts.http_port is not None else 8000,
            "api_key": opts.api_key, "seed": opts.seed, "runtime_dir": "/r", "marker_path": "/r/m",
            "gate_path": "/r/g", "lease_path": "/r/l", "lease_seconds": opts.lease_seconds,
            "max_queue": opts.max_queue}
    try:
        parse_rank_spec(spec, source="the rank contract of these launch options")
    except ClusterctlError as e:
        bad.append(e.message)
    if not valid_host(str(opts.http_host)):
        bad.append(f"http_host {str(opts.http_host)[:80]!r} is not an address rank 0 can bind")
    for name in ("timeout", "grace", "lease_seconds"):
        v = getattr(opts, name, None)
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(f"{name} {v} is not finite")
    return bad


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from clusterctl.errors import MissingInput
    from modelfiles import make_model

    root = tmp_path_factory.mktemp("cli-fuzz")
    cwd = root / "cwd"
    cwd.mkdir()
    model = make_model(root / "model", layers=4, hidden=32)
    cluster = root / "cluster.toml"
    cluster.write_text("[cluster]\nname = \"fz\"\n" + "".join(
        f'[[node]]\nname = "{n}"\nlocal = true\nmemory_gb = 4\nruntime_dir = "{root}/run-{n}"\n' for n in "ab"))
    w = World(root=root, state=root / "state", cwd=cwd, cluster=cluster, model=model)

    def stopped(what):
        return MissingInput(f"fuzz: stopped before {what}")

    async def fake_launch(dep_ref, state, opts, *, log=None, **kw):
        w.oracle.extend(_check_launch_options(opts))
        raise stopped("the launch")

    def fake_build(*a, **kw):
        raise stopped("building a model")

    async def fake_demo(*a, **kw):
        raise stopped("the demo")

    async def fake_front(*a, **kw):  # a front in the foreground would serve until stopped
        raise stopped("the front")

    def fake_spawn(*a, **kw):
        raise stopped("starting a front")

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        # an empty CLUSTERCTL_STATE_DIR falls back to the user's state dir: let that be one of ours too
        mp.setenv("HOME", str(root / "home"))
        mp.setenv("XDG_STATE_HOME", str(root / "home" / ".local" / "state"))
        mp.setenv("CLUSTERCTL_STATE_DIR", str(w.state))
        mp.delenv("CLUSTERCTL_CLUSTER", raising=False)
        mp.delenv("CLUSTERCTL_LAUNCHER_LEASE", raising=False)
        mp.delenv("CLUSTERCTL_API_KEY", raising=False)
        mp.setattr("clusterctl.launch.start.launch", fake_launch)
        mp.setattr("clusterctl.modelfiles.tiny.build", fake_build)
        mp.setattr("clusterctl.launch.demo.run_demo", fake_demo)
        mp.setattr("clusterctl.front.proxy.serve", fake_front)
        mp.setattr("clusterctl.front.records.spawn_front", fake_spawn)
        cache_typer_command(mp)
        yield w


_count_cases, _report_cases = counting_fixtures("CLI fuzz cases per command")


def base_value(p: Param, w: World) -> str:
    """A valid value for a required parameter, chosen so the command stops early (a name that does not exist)."""
    if p.name == "cluster":
        return str(w.cluster)
    if p.name in ("model", "folder"):
        return str(w.model)
    if p.name == "address":  # `front run HOST:PORT`: one that parses, so the run reaches its stubbed serve
        return "127.0.0.1:9"
    if p.kind == "path":
        return str(w.root / f"no-such-{p.name}")
    if p.kind in ("int", "float"):
        return "1"
    return f"no-such-{p.name}"


def argv_for(cmd: tuple[str, ...], params: list[Param], assign: dict[str, object]) -> list[str]:
    """The argv of ``cmd`` with ``assign`` (name -> value, True for a flag, list for a repeatable option);
    arguments go after ``--`` so a value that starts with '-' reaches the command as a value."""
    argv = list(cmd)
    positional = []
    for p in params:
        if p.name not in assign:
            continue
        v = assign[p.name]
        if p.is_argument:
            positional.append(str(v))
        elif p.kind == "flag":
            if v:
                argv.append(p.opts[0])
        else:
            for one in (v if isinstance(v, list) else [v]):
                argv.append(f"{p.opts[0]}={one}")
    return argv + (["--", *positional] if positional else [])


@pytest.fixture(scope="module")
def bases(world):
    """Per command: the assignments of a run that parses (not exit 2) and stops early. Required parameters get
    base values; if that still is a usage error (a rule like cancel's "--request or --all", or replan's "name the
    deployment"), one flag or one optional parameter with a base value is added, the first that makes it parse."""
    out = {}
    for cmd, params in COMMANDS.items():
        assign = {p.name: base_value(p, world) for p in params if p.required}
        if any(p.name == "state_dir" for p in params):
            assign["state_dir"] = str(world.state)
        tries = [{}] + [{p.name: True} for p in params if p.kind == "flag"] + \
                [{p.name: [base_value(p, world)] if p.multiple else base_value(p, world)}
                 for p in params if not p.required and p.kind != "flag" and p.name != "state_dir"]
        for extra in tries:
            r = run_cli(argv_for(cmd, params, {**assign, **extra}))
            if r.code not in (2, 70):
                out[cmd] = ({**assign, **extra}, r.code)
                break
        else:
            out[cmd] = (assign, None)
    return out


# ---- the checks -------------------------------------------------------------------------------------------------

def run_case(w: World, bases, cmd, assign_extra: dict, *, env_extra: dict | None = None, json_flag=False,
             drop: tuple[str, ...] = ()) -> tuple[list[str], object]:
    params = COMMANDS[cmd]
    base, _ = bases[cmd]
    assign = {k: v for k, v in base.items() if k not in drop}
    assign.update(assign_extra)
    if json_flag and any(p.name == "json" for p in params):
        assign["json"] = True
    argv = argv_for(cmd, params, assign)
    env = dict(env_extra or {})
    why = []
    for p in params:
        if p.name in assign_extra and p.kind != "flag":
            values = assign_extra[p.name] if isinstance(assign_extra[p.name], list) else [assign_extra[p.name]]
            why += [x for x in (must_be_usage_error(p, str(v)) for v in values) if x]
        for var in p.envvars:
            if var in env and p.name not in assign:
                why += [x for x in [must_be_usage_error(p, env[var])] if x]
    values = [str(x) for v in assign_extra.values() if v is not True for x in (v if isinstance(v, list) else [v])]
    w.oracle.clear()
    os.chdir(w.cwd_of(cmd))
    r = run_cli(argv, env=env)
    bad = check(r, argv, values + list(env.values()), why)
    bad += [f"launch accepted a value a rank refuses: {o[:200]}" for o in w.oracle]
    count("refused" if r.code else "accepted")
    return bad, r


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else f"{s[:40]}...<{len(v)} chars>"


def _fail_with(found: dict[str, list[str]]) -> None:
    if found:
        lines = [f"{k}: " + "; ".join(dict.fromkeys(v)) for k, v in found.items()]
        pytest.fail(f"{len(found)} broken promise(s):\n  " + "\n  ".join(lines), pytrace=False)


# ---- tests ----------------------------------------------------------------------------------------------------------

def test_every_command_is_fuzzed(bases):
    """The introspection found the commands, and each has a base run that parses: fuzzing it is not vacuous."""
    assert ("plan",) in COMMANDS and ("model", "tiny") in COMMANDS and len(COMMANDS) >= 10, sorted(COMMANDS)
    vacuous = [" ".join(c) for c, (_, code) in bases.items() if code is None]
    assert not vacuous, f"no argv of these commands parses, so their fuzzing would prove nothing: {vacuous}"


def test_the_launch_stub_takes_the_defaults():
    """The launch stub's check of the values (the rank contract they end up in) passes launch's own defaults: when
    it complains, it is about a fuzzed value, not about its own template."""
    from clusterctl.launch.jobplan import LaunchOptions

    assert _check_launch_options(LaunchOptions()) == []


CMD_IDS = [" ".join(c) for c in COMMANDS]


@pytest.mark.parametrize("cmd", list(COMMANDS), ids=CMD_IDS)
def test_boundary_values_of_every_parameter(world, bases, cmd):
    """Every parameter (argument, option, and the env var behind it) of the command gets every boundary number and
    every hostile string, with and without --json."""
    if bases[cmd][1] is None:
        pytest.skip("no base run parses (test_every_command_is_fuzzed says which)")
    found: dict[str, list[str]] = collections.defaultdict(list)
    i = 0
    for p in COMMANDS[cmd]:
        if p.kind == "flag" or p.name in ("json", "quiet"):
            continue
        for v in NUMERIC_EDGES + HOSTILE:
            i += 1
            value = [v] if p.multiple else v
            bad, _ = run_case(world, bases, cmd, {p.name: value}, json_flag=bool(i % 2))
            for b in bad:
                found[f"{' '.join(cmd)} {p.label}={_show(v)}{' --json' if i % 2 else ''}"].append(b)
            for var in p.envvars:  # the same value through the option's env var (an empty one counts as unset)
                if v == "":
                    continue
                bad, _ = run_case(world, bases, cmd, {}, env_extra={var: v}, drop=(p.name,))
                for b in bad:
                    found[f"{var}={_show(v)} {' '.join(cmd)}"].append(b)
    _fail_with(found)


ARGV_TEXT = st.characters(exclude_characters="\x00")  # a NUL cannot be in argv or the environment (execve)
VALUES = st.one_of(st.sampled_from([v for v in NUMERIC_EDGES + HOSTILE if len(v) < LONG]),  # 1 MB: sweep only
                   st.integers(min_value=-(2**70), max_value=2**70).map(str),
                   st.floats().map(repr),
                   st.text(ARGV_TEXT, max_size=40),
                   st.text(ARGV_TEXT, max_size=20).map(lambda s: "../" + s))


@pytest.mark.parametrize("cmd", list(COMMANDS), ids=CMD_IDS)
def test_random_combinations(world, bases, cmd):
    """Hypothesis: one to three parameters at once with random numbers and text, any flags, --json or not."""
    if bases[cmd][1] is None:
        pytest.skip("no base run parses")
    # status --watch runs until Ctrl-C by design (tests/launch/test_status_watch.py drives it in a terminal)
    params = {p.name: p for p in COMMANDS[cmd] if p.name not in ("json", "quiet", "watch")}
    valued = [n for n, p in params.items() if p.kind != "flag"]
    flags = [n for n, p in params.items() if p.kind == "flag"]

    @fuzz_settings(0.25 if cmd != ("plan",) else 0.1)
    @given(st.data())
    def run(data):
        extra = {}
        if valued:
            for name in data.draw(st.lists(st.sampled_from(valued), min_size=1, max_size=3, unique=True),
                                  label="parameters"):
                v = data.draw(VALUES, label=name)
                extra[name] = [v] if params[name].multiple else v
        for name in flags:
            if data.draw(st.booleans(), label=name):
                extra[name] = True
        bad, _ = run_case(world, bases, cmd, extra, json_flag=data.draw(st.booleans()))
        assert not bad, bad

    run()


def test_help_of_every_command(world):
    for path in [*groups(), *COMMANDS]:
        r = run_cli([*path, "--help"])
        assert r.code == 0 and r.stdout.strip() and not r.stderr.strip(), (path, r.code, r.stderr[-300:])
        count("accepted")


def test_a_group_alone_or_an_unknown_name_says_what_is_missing(world):
    """`clusterctl` and `clusterctl model` alone show their help (exit 0, or exit 2 with the help and no empty
    "error:" line), `clusterctl front` alone what its default command does; an unknown command or option is a
    usage error that names it."""
    found = collections.defaultdict(list)
    for g in groups():
        r = run_cli(list(g))
        default = getattr(command_at(g), "default_command", None)
        if default is not None:
            d = run_cli([*g, default])
            if (r.code, r.stdout, r.stderr) != (d.code, d.stdout, d.stderr):
                found[f"clusterctl {' '.join(g)}"].append(f"not what `{' '.join([*g, default])}` does")
            count("refused" if r.code else "accepted")
            continue
        bad = [b for b in check(r, list(g), [], []) if "printed on stdout" not in b and "without an 'error: '" not in b]
        if "Usage:" not in r.stdout + r.stderr:
            bad.append(f"exit {r.code} without the help")
        if r.code not in (0, 2):
            bad.append(f"exit {r.code}")
        for b in bad:
            found[f"clusterctl {' '.join(g)}"].append(b)
        count("refused" if r.code else "accepted")
    cases = [[*g, "no-such-command"] for g in groups()] + [[*c, "--no-such-option"] for c in COMMANDS]
    for argv in cases:
        for j in (False, True):
            a = argv + (["--json"] if j else [])
            r = run_cli(a)
            bad = check(r, a, [], ["an unknown name"])
            if r.code == 2 and "no-such" not in r.stderr:
                bad.append(f"the error does not name what is unknown: {r.stderr.strip()[:120]!r}")
            for b in bad:
                found[f"clusterctl {' '.join(a)}"].append(b)
            count("refused" if r.code else "accepted")
    _fail_with(found)


def test_replan_refuses_what_launch_refuses(world, bases):
    """`replan` relaunches with the options it shares with `launch`: a number or bind address that launch refuses
    (exit 2, or one its stub finds a rank would refuse) is refused by replan too, before anything is stopped.
    (Options whose validity depends on the environment, like --api-key-env, are left out: replan may look at
    them once it knows which job it replaces.)"""
    launch, replan = COMMANDS.get(("launch",)), COMMANDS.get(("replan",))
    if not launch or not replan:
        pytest.skip("no launch/replan pair")
    shared = [p for p in replan if (p.kind in ("int", "float") or is_host(p)) and
              any(q.name == p.name and q.kind == p.kind for q in launch)]
    assert shared, "replan and launch share no option: update this test"
    found = collections.defaultdict(list)
    for p in shared:
        for v in [v for v in NUMERIC_EDGES + HOSTILE if len(v) < LONG]:
            bad_l, rl = run_case(world, bases, ("launch",), {p.name: v})
            refused_l = rl.code == 2 or any(b.startswith("launch accepted") for b in bad_l)
            _, rr = run_case(world, bases, ("replan",), {p.name: v})
            if refused_l and rr.code != 2:
                found[f"replan {p.label}={_show(v)}"].append(
                    f"launch refuses it (exit {rl.code}{', rank contract' if rl.code != 2 else ''}) but replan "
                    f"exits {rr.code}")
    _fail_with(found)

