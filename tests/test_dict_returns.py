"""Above the typed node wire the coordinator passes models, not dicts (issue 50 item 3): a function that returns a
dict literal with fixed keys (``return {"state": ..., "why": ...}``) hands its callers a record every reader must
know the keys of; a model (or a dataclass) names them once. Dicts stay at the JSON edge: ``cli/`` and
``render.py``, the ``to_json`` methods (what ``--json`` prints and the files on disk hold), ``protocol/`` (the
formats themselves), the fake transports' node-op answers (the node wire's JSON lines, as a node sends them), and
the documents of formats clusterctl does not own (``EXTERNAL``).

Counted by AST: a function (each nested one on its own) with a ``return`` whose value is a dict literal with
constant string keys (``**spread`` beside them too), or such a literal as an element of a returned list, tuple,
set, comprehension or conditional expression. At most ``MAX_OUTSIDE`` outside the edge, besides ``FOR_NOW``:
the ones left in ``supervise/`` and ``rank/``, whose own items of issue 50 (4: the supervisor's records and
state file; 1 and 2: the rank) take them out. A name in ``EXTERNAL`` or ``FOR_NOW`` that no longer returns such
a dict fails the test: take it off the list, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "clusterctl"
MAX_OUTSIDE = 5

EDGE_FOLDERS = ("cli/", "protocol/")
EDGE_MODULES = ("render.py",)
FAKE_WIRES = ("connect/faketransport.py", "launch/fakecluster.py")  # their ``_op_*``: a node's answers, faked

# documents in a format someone else defines, built where they are written
EXTERNAL = {
    "gguf/plan.py:_rope_scaling": "config.json's rope_scaling, as transformers reads it",
    "gguf/plan.py:_llama3_scaling": "config.json's rope_scaling of a llama3 model",
    "modelfiles/tiny.py:_config": "a tiny model's config.json",
    "modelfiles/folder.py:_entry": "one entry of a safetensors header",
    "launch/hostfile.py:mlx_launch_hostfile": "MLX's hostfile (mlx.launch's JSON)",
}

# left for the other items of issue 50: each one that goes takes its line with it
FOR_NOW = {
    "supervise/watch.py:rank_record": "item 4: the supervisor's rank records",
    "rank/api/openai.py:_reasoned": "items 1-2: the rank",
    "rank/api/openai.py:_chat_grammar": "items 1-2: the grammar union type",
    "rank/api/requests.py:grammar": "items 1-2: the grammar union type",
    "rank/api/service.py:model_card": "items 1-2: the rank",
    "rank/api/splitter.py:delta": "items 1-2: the rank",
    "rank/api/tools.py:_arguments_schema": "items 1-2: the rank",
    "rank/engine/logprobs.py:one": "items 1-2: the rank",
    "rank/engine/logprobs.py:chat_shape": "items 1-2: the rank",
    "rank/engine/logprobs.py:completion_shape": "items 1-2: the rank",
    "rank/grammar/mask.py:_schema_of": "items 1-2: the grammar union type",
    "rank/grammar/mask.py:json_schema": "items 1-2: the grammar union type",
}


def _fixed_keys(node: ast.AST) -> bool:
    return (isinstance(node, ast.Dict) and any(k is not None for k in node.keys)
            and all(k is None or (isinstance(k, ast.Constant) and isinstance(k.value, str)) for k in node.keys))


def _returned(value: ast.AST):
    """What a return hands out: the value, or each element of a returned collection or either branch."""
    if isinstance(value, (ast.List, ast.Tuple, ast.Set)):
        for e in value.elts:
            yield from _returned(e)
    elif isinstance(value, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        yield from _returned(value.elt)
    elif isinstance(value, ast.IfExp):
        yield from _returned(value.body)
        yield from _returned(value.orelse)
    else:
        yield value


def _own_returns(fn: ast.AST):
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue  # counted on its own
        if isinstance(n, ast.Return) and n.value is not None:
            yield n
        todo.extend(ast.iter_child_nodes(n))


def dict_returners() -> dict[str, int]:
    """``module:function`` -> its line, for every function of src/clusterctl that returns a fixed-key dict."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    _fixed_keys(v) for r in _own_returns(fn) for v in _returned(r.value)):
                out[f"{rel}:{fn.name}"] = fn.lineno
    return out


def at_the_edge(name: str) -> bool:
    rel, fn = name.split(":")
    return (rel.startswith(EDGE_FOLDERS) or rel in EDGE_MODULES or fn == "to_json"
            or (rel in FAKE_WIRES and fn.startswith("_op_")) or name in EXTERNAL)


def test_at_most_five_functions_outside_the_json_edge_return_fixed_key_dicts() -> None:
    found = dict_returners()
    outside = sorted(f"{n} (line {line})" for n, line in found.items() if not at_the_edge(n) and n not in FOR_NOW)
    assert len(outside) <= MAX_OUTSIDE, (
        f"{len(outside)} functions return fixed-key dict literals outside cli/, render.py and the JSON edge (at most "
        f"{MAX_OUTSIDE}): return a model or a dataclass (its to_json at the edge):\n" + "\n".join(outside))


def test_the_named_lists_only_name_what_is_still_there() -> None:
    found = dict_returners()
    gone = sorted(n for n in {**EXTERNAL, **FOR_NOW} if n not in found)
    assert not gone, "no longer return a fixed-key dict: take them off EXTERNAL / FOR_NOW:\n" + "\n".join(gone)


def test_the_counter_sees_the_shapes_it_counts() -> None:
    src = '''
def plain(): return {"a": 1}
def spread(x): return {"a": 1, **x}
def rows(xs): return [{"a": x} for x in xs]
def either(c): return {"a": 1} if c else None
def keyed(k): return {k: 1}
def built(): return dict(a=1)
def outer():
    def inner(): return {"a": 1}
    return inner
'''
    tree = ast.parse(src)
    got = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
           and any(_fixed_keys(v) for r in _own_returns(fn) for v in _returned(r.value))}
    assert got == {"plain", "spread", "rows", "either", "inner"}
