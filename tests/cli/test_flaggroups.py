"""Flag groups (cli/flaggroups.py): a dataclass of typer options taken by a command as one parameter. Typer parses
each flag as if the command listed it; the command gets the dataclass built from what was parsed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from clusterctl.cli.flaggroups import Without, flag_groups


@dataclass(frozen=True)
class Pair:
    left: Annotated[int, typer.Option("--left", help="The left one.", min=0)] = 1
    right: Annotated[Optional[str], typer.Option("--right", help="The right one.")] = None


def _app(command) -> typer.Typer:
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)  # two commands: the command is named on argv
    return app


def test_the_command_gets_the_group_built_from_the_parsed_flags():
    got = []

    @flag_groups
    def go(*, name: Annotated[str, typer.Argument()], pair: Pair, last: Annotated[bool, typer.Option("--last")] = False):
        got.append((name, pair, last))

    r = CliRunner().invoke(_app(go), ["go", "x", "--left", "3", "--right", "r", "--last"])
    assert r.exit_code == 0, r.output
    assert got == [("x", Pair(left=3, right="r"), True)]
    r = CliRunner().invoke(_app(go), ["go", "y"])
    assert r.exit_code == 0 and got[-1] == ("y", Pair(), False)
    r = CliRunner().invoke(_app(go), ["go", "y", "--left", "-1"])  # typer checks each flag as declared
    assert r.exit_code == 2 and len(got) == 2


def test_the_flags_stand_where_the_group_does_with_their_help():
    @flag_groups
    def go(*, first: Annotated[bool, typer.Option("--first")] = False, pair: Pair,
           last: Annotated[bool, typer.Option("--last")] = False):
        pass

    r = CliRunner().invoke(_app(go), ["go", "--help"], env={"COLUMNS": "200"})
    text = r.output
    assert r.exit_code == 0 and "The left one." in text and "The right one." in text
    assert text.index("--first") < text.index("--left") < text.index("--right") < text.index("--last")


def test_without_leaves_flags_out_at_their_defaults():
    got = []

    @flag_groups
    def go(*, pair: Annotated[Pair, Without("right")]):
        got.append(pair)

    assert CliRunner().invoke(_app(go), ["go", "--left", "2"]).exit_code == 0 and got == [Pair(left=2)]
    r = CliRunner().invoke(_app(go), ["go", "--right", "r"])
    assert r.exit_code == 2 and "--right" in r.output


def test_a_flag_given_twice_or_an_unknown_one_left_out_is_refused_at_import():
    with pytest.raises(TypeError, match="given twice"):
        @flag_groups
        def twice(*, pair: Pair, left: int = 0):
            pass
    with pytest.raises(TypeError, match="no flag"):
        @flag_groups
        def unknown(*, pair: Annotated[Pair, Without("middle")]):
            pass


def test_launch_replan_and_supervise_share_the_serving_flags():
    """Every LaunchFlags flag is one definition: launch takes all of them, replan and supervise all but launch's
    own (--lease, --port, --verify), with the same names and help."""
    from dataclasses import fields

    from clusterctl.cli import app
    from clusterctl.cli.launchflags import LaunchFlags

    root = typer.main.get_command(app)

    def flags(cmd):
        return {p.name: (tuple(p.opts), p.help) for p in root.commands[cmd].params}

    launch, replan, supervise = flags("launch"), flags("replan"), flags("supervise")
    names = {f.name for f in fields(LaunchFlags)}
    assert names <= set(launch)
    assert {n: launch[n] for n in names - {"lease", "port", "verify"}} == {n: replan[n] for n in
                                                                         names - {"lease", "port", "verify"}}
    assert {n: replan[n] for n in names & set(replan)} == {n: supervise[n] for n in names & set(supervise)}
    assert not {"lease", "port", "verify"} & (set(replan) | set(supervise))
