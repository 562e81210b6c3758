"""The package rules of docs/architecture.md, checked on the source (every import, at the top or in a function).

- a node-side module (``clusterctl.node``) imports only the standard library, psutil and the shared protocol
  modules — never the coordinator;
- ``clusterctl.plan`` imports neither ``clusterctl.launch`` nor ``clusterctl.sync``;
- no import cycles between modules at import time (the imports at the top of a module).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "clusterctl"

# What both sides of the wire share: the file formats and their readers and writers, the error root, the
# identifiers, the atomic writes, and the model manifest a node checks its copy against.
SHARED = {"clusterctl", "clusterctl.errors", "clusterctl.names", "clusterctl.atomic", "clusterctl.locks",
          "clusterctl.launch.runtimefiles", "clusterctl.sync.manifest", "clusterctl.sync.copycheck",
          "clusterctl.sync.download"}
# Third-party modules a node-side module may import: psutil; mlx only inside the probe that reports whether
# this node's mlx can use the planned backend (that is what it checks); pydantic only through SHARED.
NODE_THIRD_PARTY = {"psutil", "mlx"}
SHARED_THIRD_PARTY = {"pydantic", "platformdirs"}  # platformdirs: where the model-hash cache lives


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, *, top_only: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as a.b, and as a.b.c when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    out: set[str] = set()
    nodes = tree.body if top_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".")[: -node.level] if not path.name == "__init__.py" else me.split(".")[: len(
                    me.split(".")) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            subs = {a.name for a in node.names if _is_module(f"{base}.{a.name}")}
            out.update(f"{base}.{n}" for n in subs)
            if len(subs) < len(node.names):  # names from the module itself (a package's submodules alone: not)
                out.add(base)
    return out


def _is_module(name: str) -> bool:
    p = PKG.parent / name.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def modules(under: str = "") -> dict[str, Path]:
    root = PKG / under.replace(".", "/") if under else PKG
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


def test_node_side_modules_import_only_the_stdlib_psutil_and_the_shared_protocol():
    node = modules("node")
    assert node, "the node-side package clusterctl.node is missing"
    bad = []
    for name, path in node.items():
        for imp in sorted(imports(path)):
            top = imp.split(".")[0]
            if top == "clusterctl":
                if not (imp in SHARED or imp == "clusterctl.node" or imp.startswith("clusterctl.node.")):
                    bad.append(f"{name} imports {imp}")
            elif top not in sys.stdlib_module_names and top not in NODE_THIRD_PARTY and top != "__future__":
                bad.append(f"{name} imports {imp}")
    assert not bad, "node-side modules reach beyond the shared protocol:\n" + "\n".join(bad)


def test_the_shared_protocol_modules_import_only_each_other():
    bad = []
    for name in sorted(SHARED - {"clusterctl"}):
        path = PKG.parent / (name.replace(".", "/") + ".py")
        for imp in sorted(imports(path)):
            top = imp.split(".")[0]
            if top == "clusterctl":
                if imp not in SHARED:
                    bad.append(f"{name} imports {imp}")
            elif top not in sys.stdlib_module_names and top not in SHARED_THIRD_PARTY and top != "__future__":
                bad.append(f"{name} imports {imp}")
    assert not bad, "\n".join(bad)


def test_plan_imports_neither_launch_nor_sync():
    bad = [f"{name} imports {imp}" for name, path in modules("plan").items() for imp in sorted(imports(path))
           if imp.startswith(("clusterctl.launch", "clusterctl.sync"))]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli():
    bad = [f"{name} imports {imp}" for name, path in modules().items() for imp in imports(path)
           if imp.startswith("clusterctl.cli") and not name.startswith("clusterctl.cli") and name != "clusterctl.__main__"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    mods = modules()
    graph = {name: {i for i in imports(path, top_only=True) if i in mods and i != name} for name, path in mods.items()}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
