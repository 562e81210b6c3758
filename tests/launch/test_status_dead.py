"""`status` shows a rank that died without a word as dead (its process gone, identity-checked on its node) or lost
(its heartbeat stale), whatever its marker and the job's manifest still say; and the tables fit narrow terminals.
Against fake nodes (connect/faketransport.py: the real coordinator code and op sessions) and real Rich rendering;
the same against real ranks in test_status_watch.py."""

import asyncio

import pytest

from clusterctl.connect.faketransport import NodeOpError, ScriptedOps, fake_ssh
from clusterctl.launch.status import rank_state, status
from clusterctl.statedir.state import StateDir
from test_fake_nodes import job as _job


def job(state: StateDir):
    """The fake nodes' job of two ranks (a, b), its manifest saying ready as a launched job's does."""
    from clusterctl.statedir.manifest import ManifestStore

    m = _job(state)
    m.state = "ready"
    ManifestStore(state.launches, state.keyring.signing_key(), state.keyring.public_keys()).save(m)
    return m


@pytest.fixture
def state(tmp_path):
    return StateDir(tmp_path / "state")


@pytest.mark.parametrize("marker, process, stale, reachable, shown", [
    ("serving", "alive", False, True, "serving"),
    ("serving", "dead", False, True, "dead"),        # SIGKILLed a moment ago: its marker still looks fresh
    ("serving", "foreign", False, True, "dead"),     # the pid now belongs to another process
    ("ready", None, True, True, "lost"),             # no heartbeat, process not known: not serving either
    ("serving", "alive", True, True, "lost"),        # wedged or SIGSTOPped
    ("serving", "unverifiable", True, True, "lost"),
    ("loading", "dead", False, True, "dead"),
    ("stopping", "dead", True, True, "stopped"),
    ("failed", "dead", True, True, "failed"),        # a rank's last word says more than "dead"
    ("lost", "dead", True, True, "lost"),
    (None, "dead", False, True, "dead"),
    (None, "alive", False, True, "no marker"),
    ("serving", None, False, False, "unreachable"),
])
def test_rank_state(marker, process, stale, reachable, shown):
    assert rank_state(marker, process, stale, reachable) == shown


def node(rank: int, *, alive: str = "alive", age: float = 0.2, marker_state: str = "serving") -> ScriptedOps:
    seen = []

    def alive_op(req):
        seen.append(req["targets"])
        return {"status": [alive for _ in req["targets"]]}

    ops = ScriptedOps({
        "markers": lambda req: {"markers": [{"marker": {"rank": rank, "state": marker_state, "active_requests": [],
                                                        "job_id": "dep-x-1"}, "age": age}]},
        "alive": alive_op,
    })
    ops.seen = seen
    return ops


def test_a_dead_rank_under_a_ready_job_is_shown_dead(state):
    job(state)
    a, b = node(0), node(1, alive="dead")
    doc = asyncio.run(status(state, fake_ssh({"a": a, "b": b}))).to_json()
    [j] = doc["jobs"]
    assert j["state"] == "ready" and j["ranks_down"] == 1
    assert [(r["state"], r["marker_state"], r["process"]) for r in j["ranks"]] == [
        ("serving", "serving", "alive"), ("dead", "serving", "dead")]
    # the identity the launch recorded is what the node checks: pid, start time, the job's nonce, boot id
    [[t]] = b.seen
    assert (t["pid"], t["start_time"], t["boot_id"]) == (1001, 1.0, "boot") and len(t["nonce"]) == 32


def test_a_stale_heartbeat_is_lost_and_an_unanswered_alive_changes_nothing(state):
    job(state)
    a = node(0, age=9.0)
    b = ScriptedOps({"markers": lambda req: {"markers": [{"marker": {"rank": 1, "state": "serving",
                                                                     "job_id": "dep-x-1"}, "age": 0.1}]},
                     "alive": lambda req: (_ for _ in ()).throw(NodeOpError("psutil missing"))})
    doc = asyncio.run(status(state, fake_ssh({"a": a, "b": b}))).to_json()
    [j] = doc["jobs"]
    assert [(r["state"], r["process"]) for r in j["ranks"]] == [("lost", "alive"), ("serving", None)]
    assert j["ranks_down"] == 1


def _render(renderable, width: int) -> list[str]:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(renderable)
    return [ln.rstrip() for ln in out.getvalue().splitlines()]


def _doc(state) -> dict:
    job(state)
    doc = asyncio.run(status(state, fake_ssh({"a": node(0), "b": node(1, alive="dead")}))).to_json()
    for r in doc["jobs"][0]["ranks"]:
        r.update(tok_s=12.5 if r["rank"] == 0 else None, batch=3, queued=0, step_s=0.01, idle_share=0.5,
                 rss_bytes=1 << 27, prompt_cache=[1, 20, 300], ladder="-")
    return doc


@pytest.mark.parametrize("width", [20, 24, 40, 80, 200])
def test_watch_view_fits_any_width_and_keeps_rank_and_state(state, width):
    from clusterctl.render import WATCH_COLUMNS, watch_view

    lines = _render(watch_view(_doc(state)), width)
    assert all(len(ln) <= width for ln in lines), lines
    assert lines[0].startswith("ready 1/2 down") or lines[0].startswith("dep-x-1  ready 1/2 down"), lines
    header = lines[1].split()
    assert header[:1] == ["RANK"] and "STATE" in header, lines
    rows = {ln.split()[0]: ln.split() for ln in lines[2:4]}
    assert rows["0"][header.index("STATE")] == "serving" and rows["1"][header.index("STATE")] == "dead", lines
    assert "…" not in "".join(lines[1:]), lines  # no cell squeezed to an ellipsis: columns are left out instead
    names = [c for c, _, _ in WATCH_COLUMNS]
    assert header == [c for c in names if c in header]  # the columns shown keep their order
    if width >= 200:
        assert header == names and lines[0].startswith("dep-x-1  ready 1/2 down")
    elif width <= 24:
        assert header == ["RANK", "NODE", "STATE"], lines


def test_status_table_fits_a_narrow_terminal_too(state):
    from clusterctl.render import status_table

    doc = _doc(state)
    lines = _render(status_table(doc["jobs"][0]), 24)
    assert all(len(ln) <= 24 for ln in lines) and lines[1].split()[:1] == ["RANK"] and "dead" in lines[3], lines
    wide = _render(status_table(doc["jobs"][0], wide=True), 250)
    assert wide[1].split()[:8] == ["RANK", "NODE", "HOST", "PID", "STATE", "LAYERS", "HEARTBEAT", "ACTIVE"]
