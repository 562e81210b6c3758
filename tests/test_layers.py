"""The package rules of docs/architecture.md, checked on the source: every import, at the top of a module or
inside a function.

- packages match where code runs: ``rank`` (the rank process) and ``node`` (the node-side programs) import only
  ``protocol``, ``modelfiles``, the base modules and (the rank) ``ple``; never the coordinator; ``protocol`` imports
  only the base modules; ``plan`` only ``protocol``, ``modelfiles`` and the base modules;
- no cycle between packages, none between modules, counting imports inside functions too;
- an import of clusterctl's own modules inside a function has a reason the code can show, and there are at most
  ``MAX_DEFERRED`` of them: the module it imports loads a heavy third-party library the importer does not load
  at its top (the coordinator must not load MLX, nor the rank's control plane numpy), the CLI loads a command's
  code only when the command runs (startup).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "clusterctl"

BASE = {"clusterctl", "clusterctl.errors", "clusterctl.atomic", "clusterctl.names", "clusterctl.locks",
        "clusterctl.hardexit"}
# Third-party libraries whose import takes long or pulls much: a module that does not load one at its top loads it
# only where it is needed (a function), and so may a module that imports one of those.
HEAVY = {"mlx", "mlx_lm", "numpy", "transformers", "asyncssh", "aiohttp", "jinja2", "openai",
         "safetensors", "tokenizers", "sentencepiece", "huggingface_hub", "lark", "outlines", "xgrammar"}
MAX_DEFERRED = 60
# The CLI imports a command's code (the coordinator's packages) when that command runs: every invocation, cron's
# `reap` each minute and `--help` included, would otherwise load all of it (0.21 s -> 0.50 s per start); the base modules too where they load pydantic (names).
COMMAND_CODE = {"launch", "sync", "plan", "protocol", "connect", "statedir", "front", "supervise", "gguf", "modelfiles"}
# What each package may import of clusterctl (besides itself and the base modules).
ALLOWED = {
    "protocol": set(),
    "modelfiles": {"protocol"},
    "plan": {"protocol", "modelfiles"},
    "ple": {"protocol", "modelfiles"},
    "node": {"protocol", "modelfiles"},
    "rank": {"protocol", "modelfiles", "ple"},
}
# Third-party modules node-side code may import: psutil; mlx only inside the probe that reports whether this
# node's mlx can use the planned backend; pydantic and platformdirs through protocol.
NODE_THIRD_PARTY = {"psutil", "mlx", "pydantic", "platformdirs"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = PKG.parent / name.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def import_nodes(path: Path, text: str | None = None, *,
                 runtime: bool = False) -> list[tuple[ast.AST, set[str], bool]]:
    """Each import statement of ``path``: (node, the modules it names, whether it is at the module's top).

    ``from a.b import c`` names a.b.c when that is a module, else a.b; an import under ``if TYPE_CHECKING`` or in
    a try at the top counts as the top. ``runtime``: without the imports under ``if TYPE_CHECKING`` (annotations
    only: they are a dependency of the design, so they count for layers and cycles, but nothing loads them)."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    me = module_name(path)
    top: set[int] = set()
    typing_only: set[int] = set()
    for stmt in tree.body:
        for n in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            top.add(id(n))
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                typing_only.add(id(n))
    out = []
    for node in ast.walk(tree):
        if runtime and id(node) in typing_only:
            continue
        names: set[str] = set()
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            subs = {a.name for a in node.names if _is_module(f"{base}.{a.name}")}
            names = {f"{base}.{n}" for n in subs}
            if len(subs) < len(node.names):
                names.add(base)
        else:
            continue
        out.append((node, names, id(node) in top))
    return out


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@cache
def graph(top_only: bool, runtime: bool = False) -> dict[str, set[str]]:
    return {name: {i for node, names, top in import_nodes(path, runtime=runtime)
                   for i in names if top or not top_only}
            for name, path in modules().items()}


def package(module: str) -> str:
    """clusterctl.rank.api.service -> rank; clusterctl.errors -> the base; clusterctl.render -> render (top level)."""
    if module in BASE:
        return "base"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "base"


@cache
def reach(module: str) -> frozenset[str]:
    """The third-party top-level names ``module`` loads when imported (through its top-level imports)."""
    seen, todo, out = set(), [module], set()
    g = graph(True, runtime=True)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for i in g.get(m, ()):
            top = i.split(".")[0]
            if top == "clusterctl":
                if i in g:
                    todo.append(i)
                    parts = i.split(".")
                    todo.extend(".".join(parts[:k]) for k in range(1, len(parts)))  # its packages' __init__ first
            elif top not in sys.stdlib_module_names and top != "__future__":
                out.add(top)
    return frozenset(out)


def deferred_imports() -> list[tuple[str, int, str, str]]:
    """Every import of clusterctl's own modules inside a function: (module, line, what it imports, its reason or '')."""
    out = []
    for name, path in modules().items():
        for node, names, top in import_nodes(path):
            if top:
                continue
            for imp in sorted(n for n in names if n.startswith("clusterctl")):
                heavy = (reach(imp) & HEAVY) - reach(name)
                if heavy:
                    reason = "heavy: " + ", ".join(sorted(heavy))
                elif package(name) == "cli" and (package(imp) in COMMAND_CODE or "pydantic" in reach(imp) - reach(name)):
                    reason = "startup"
                else:
                    reason = ""
                out.append((name, node.lineno, imp, reason))
    return out


def test_the_packages_import_only_what_their_side_may():
    bad = []
    for name, deps in graph(False).items():
        pkg = package(name)
        if pkg not in ALLOWED:
            continue
        for imp in sorted(deps):
            top = imp.split(".")[0]
            if top == "clusterctl":
                other = package(imp)
                if other not in ("base", pkg) and other not in ALLOWED[pkg]:
                    bad.append(f"{name} imports {imp}")
    assert not bad, "imports across the package rules:\n" + "\n".join(bad)


def test_node_side_programs_need_only_the_stdlib_psutil_and_pydantic():
    """A node runs ``clusterctl.node`` with few packages: it and every shared module it uses (at any depth)
    import no other third-party library."""
    g = graph(False)
    todo = [m for m in g if package(m) == "node"]
    seen: set[str] = set()
    bad = []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for imp in sorted(g[m]):
            top = imp.split(".")[0]
            if top == "clusterctl":
                if imp in g:
                    todo.append(imp)
            elif top not in sys.stdlib_module_names and top != "__future__" and top not in NODE_THIRD_PARTY:
                bad.append(f"{m} imports {imp}")
    assert not bad, "\n".join(bad)


def test_the_base_modules_import_only_each_other():
    bad = [f"{name} imports {imp}" for name in BASE - {"clusterctl"} for imp in graph(False)[name]
           if imp.startswith("clusterctl") and imp not in BASE]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli():
    bad = [f"{name} imports {imp}" for name, deps in graph(False).items() for imp in deps
           if imp.startswith("clusterctl.cli") and package(name) != "cli" and name != "clusterctl.__main__"]
    assert not bad, "\n".join(bad)


def _cycles(g: dict[str, set[str]]) -> list[str]:
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    return cycles


def test_no_cycle_between_packages_counting_every_import():
    pkgs: dict[str, set[str]] = {}
    for name, deps in graph(False).items():
        a = package(name)
        pkgs.setdefault(a, set()).update(package(i) for i in deps if i.startswith("clusterctl") and package(i) != a)
    cycles = _cycles(pkgs)
    assert not cycles, "cycles between packages:\n" + "\n".join(cycles)


def test_no_import_cycles_between_modules_counting_every_import():
    """None at import time, and none through an import inside a function either (issue 43: a deferred import
    that "would close a cycle" is a cycle all the same; generation <-> sampling and handler <-> routes were)."""
    mods = modules()
    g = {name: {i for i in deps if i in mods and i != name} for name, deps in graph(False).items()}
    cycles = _cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_import_inside_a_function_has_a_reason_and_there_are_few():
    found = deferred_imports()
    unjustified = [f"{m}:{line} imports {imp} inside a function: nothing heavy; import it at the top"
                   for m, line, imp, reason in found if not reason]
    assert not unjustified, "\n".join(unjustified)
    assert len(found) <= MAX_DEFERRED, (f"{len(found)} imports of clusterctl's modules inside functions "
                                        f"(at most {MAX_DEFERRED}):\n" + "\n".join(f"{m}:{l} {i} ({r})"
                                                                                for m, l, i, r in found))


def test_the_checker_sees_imports_inside_functions():
    """The rules above read function bodies: an import of the coordinator hidden in a rank function is found."""
    hidden = "import os\n\ndef f():\n    from clusterctl.launch import start\n    from . import wire\n"
    found = {(n, top) for node, names, top in import_nodes(PKG / "rank" / "api" / "service.py", hidden) for n in names}
    assert found == {("os", True), ("clusterctl.launch.start", False), ("clusterctl.rank.api.wire", False)}
