"""Issue 43: the state dir has one owner, and every function that takes it says so (``state: StateDir``), in the
CLI too (there under ``if TYPE_CHECKING``, so that the CLI's start does not load what StateDir imports). A few
other things are called ``state`` (a grammar's, a marker's, the front's serving state): each says what it is."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "clusterctl"


def test_every_parameter_named_state_says_what_it_is():
    loose = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                if arg.arg == "state" and arg.annotation is None:
                    loose.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert not loose, "parameters named state without an annotation:\n" + "\n".join(loose)


def test_the_state_dir_is_annotated_as_itself_wherever_it_is_passed():
    """``state`` in the coordinator's packages is the state dir: annotated ``StateDir``, never another type."""
    other = []
    for pkg in ("cli", "launch", "supervise", "statedir", "connect", "plan", "sync"):
        for path in sorted((SRC / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                        if arg.arg == "state" and "StateDir" not in ast.unparse(arg.annotation or ast.Constant(None)):
                            other.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert not other, "the state dir passed without its type:\n" + "\n".join(other)
