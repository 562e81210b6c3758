"""The commands through ``typer.testing.CliRunner``: exit codes, stdout and stderr, in this process and fast.

Each call gets its own ``render.Output`` (``ctx.obj``), and an expected failure goes through the app's error edge,
so what a test sees here is what a shell sees from ``clusterctl``.
"""

import json

import pytest
from typer.testing import CliRunner

from clusterctl.cli import app
from clusterctl.render import Output


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(tmp_path / "state"))

    def go(*args, obj=None):
        return CliRunner().invoke(app, list(args), obj=obj)
    return go


def test_version_on_stdout(run):
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("clusterctl ") and r.stderr == ""


def test_history_with_nothing_applied(run):
    r = run("history")
    assert r.exit_code == 0 and r.stdout == "" and "no replan applied yet" in r.stderr
    r = run("history", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["clusters"] == [] and r.stderr == ""


def test_status_and_teardown_with_no_launches(run):
    r = run("status")
    assert (r.exit_code, r.stdout) == (0, "") and "no launches" in r.stderr
    r = run("teardown", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"schema_version": 1, "ok": True, "jobs": [], "malformed": []}


def test_an_expected_failure_is_one_line_its_code_and_a_json_document(run):
    r = run("verify", "no-such-deployment", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == doc["exit_code"] == 66 and doc["ok"] is False
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = run("replan", "--detach", "--foreground")
    assert r.exit_code == 2 and r.stdout == "" and "contradict" in r.stderr


def test_quiet_hides_the_lines_but_not_the_data(run):
    r = run("history", "-q")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", "")


def test_each_call_has_its_own_output(run):
    mine = Output()
    r = run("history", "--json", obj=mine)
    assert r.exit_code == 0 and mine.json is True
    r = run("history")
    assert r.exit_code == 0 and r.stdout == ""  # the --json of the call before does not leak into this one


def test_front_subcommands_and_the_one_command_form_of_before(run):
    """`front list|run|stop`, and what scripts typed before: `front` (the list), `front --json`, `front --stop`,
    `front HOST:PORT CLUSTER [--detach]` (docs/front.md)."""
    r = run("front", "--help")
    assert r.exit_code == 0 and all(c in r.stdout for c in ("list", "run", "stop"))
    for old, new in ((["front"], ["front", "list"]), (["front", "--json"], ["front", "list", "--json"]),
                     (["front", "--stop", "--json"], ["front", "stop", "--json"]),
                     (["front", "--stop", "127.0.0.1:9"], ["front", "stop", "127.0.0.1:9"])):
        a, b = run(*old), run(*new)
        assert (a.exit_code, a.stdout, a.stderr) == (b.exit_code, b.stdout, b.stderr) and a.exit_code == 0, old
    assert json.loads(run("front", "list", "--json").stdout) == {"schema_version": 1, "fronts": []}
    assert "no front serves 127.0.0.1:9" in run("front", "stop", "127.0.0.1:9").stderr
    for argv in (["front", "bad", "c"], ["front", "run", "bad", "c"], ["front", "stop", "bad"]):
        r = run(*argv)
        assert r.exit_code == 2 and "HOST:PORT: 'bad' is not HOST:PORT" in r.stderr, argv
    r = run("front", "127.0.0.1:9")
    assert r.exit_code == 2 and "name the cluster to follow: clusterctl front HOST:PORT CLUSTER" in r.stderr
