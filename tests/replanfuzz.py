"""The replan option matrix, walked at random (issue 30, item 5): a seeded sequence of `clusterctl plan` and
`clusterctl replan --yes` calls (the real CLI, in this process) on a deployment that is not running, with real
files in a real state dir, each call checked against the invariants of docs/replan.md:

- a call that changes any field the ranks run with (schedule, prompt cache, path_map, batch, context, layers,
  backend, parallel, ...) gives a new deployment id and one history entry; the old file stays signed, unchanged;
- a call that changes nothing is a no-op that says so ("unchanged", exit 0, no file or history written);
- `replan --to ID` of any id seen before gives back exactly that deployment (the same bytes);
- no id ever names two different deployments (a file in `<state>/deployments/` never changes what it says);
- a refusal (exit 2, 69, 78) is one error line, no traceback, and nothing on disk changed; a `--path-map` to a
  folder that does not exist is refused before anything changes (exit 69, the path named), a relative one is a
  usage error; a path that is not there never reaches a deployment.

``walk`` is what tests/plan/test_replan_matrix.py runs with a fixed seed and bench/faults.py with a random one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from cliutil import run

# What the ranks run with: a change in any of these must give another deployment (checked against the files).
RUN_FIELDS = ("backend", "parallel", "schedule", "prompt_cache_tokens", "path_map", "batch", "embedding_offload")
OK_CODES = {0, 2, 69, 78}


def model_folder(folder: Path) -> Path:
    """A model folder `launch` preflight accepts (index, shards, a tokenizer file) for the path checks."""
    from modelfiles import make_model

    m = make_model(folder, layers=8, hidden=64, shards=2)
    (m / "tokenizer.json").write_text("{}")
    return m


def _cluster(folder: Path, speeds: dict[str, float] | None = None) -> Path:
    lines = ["[cluster]", 'name = "fz"']
    for name, mem in (("a", 2), ("b", 6), ("c", 4)):
        lines += ["[[node]]", f'name = "{name}"', "local = true", f"memory_gb = {mem}",
                  f'runtime_dir = "{folder}/run-{name}"'] + ([f"speed = {speeds[name]}"] if speeds else [])
    p = folder / ("cluster-speeds.toml" if speeds else "cluster.toml")
    p.write_text("\n".join(lines) + "\n")
    return p


class World:
    def __init__(self, folder: Path, model: Path):
        self.folder = folder
        self.model = model
        self.state = folder / "state"
        self.env = {"CLUSTERCTL_STATE_DIR": str(self.state)}
        self.cluster = _cluster(folder)
        self.measured = _cluster(folder, {"a": 10.0, "b": 20.0, "c": 30.0})  # the same nodes, speeds measured
        self.dep = folder / "dep.json"
        self.copy = folder / "copy"
        shutil.copytree(model, self.copy)
        self.missing = folder / "not-there"
        self.seen: dict[str, bytes] = {}  # deployment id -> the identity it stood for (canonical JSON)
        self.log: list[str] = []

    def cli(self, *args: str):
        r = run(*args, env=self.env)
        self.log.append(f"clusterctl {' '.join(args)} -> {r.code}")
        return r

    def load(self, ref: str):
        from clusterctl.statedir.state import StateDir

        return StateDir(self.state).load_deployment(ref)[1].deployment

    def history(self) -> list[dict]:
        from clusterctl.statedir import history
        from clusterctl.statedir.state import StateDir

        return history.entries(StateDir(self.state), "fz")

    def snapshot(self) -> dict[str, bytes]:
        files = {str(p.relative_to(self.folder)): p.read_bytes() for p in (self.state / "deployments").glob("*")}
        files["dep.json"] = self.dep.read_bytes()
        h = self.state / "history" / "fz.json"
        files["history"] = h.read_bytes() if h.exists() else b""
        return files

    def remember(self, dep) -> None:
        ident = fingerprint(dep)
        old = self.seen.setdefault(dep.deployment_id, ident)
        self.check(old == ident, f"id {dep.deployment_id} names two different deployments")

    def check(self, cond: bool, why: str) -> None:
        if not cond:
            raise AssertionError(why + "\n" + "\n".join(self.log[-6:]))

    def check_files(self) -> None:
        """Every id seen still loads from the state dir and still says what it said."""
        for dep_id, ident in self.seen.items():
            dep = self.load(dep_id)
            self.check(fingerprint(dep) == ident, f"{dep_id} in the state dir changed what it says")


def fingerprint(dep) -> str:
    """The walk's own view of a deployment (not the product's identity_doc, which it checks): the whole record
    but its name, time, measured speeds and the planner's prose."""
    doc = dep.model_dump(mode="json", exclude={"deployment_id": True, "deployment_hash": True, "created_at": True,
                                               "speeds": True, "warnings": True, "allocation_reason": True,
                                               "parallel_reason": True, "schedule_reason": True,
                                               "nodes": {"__all__": {"speed"}}})
    return json.dumps(doc, sort_keys=True)


def _asked_changes(old, given: dict) -> list[str]:
    """The given options whose value differs from the current deployment's: a replan that says "unchanged"
    with any of them dropped what the operator asked for."""
    out = []
    opts = {"--schedule": "schedule", "--allocation": "allocation", "--parallel": "parallel",
            "--backend": "backend", "--context": "context", "--batch": "batch", "--prompt-cache-gb": "prompt_cache_gb",
            "--headroom-gb": "headroom_gb"}
    for flag, field in opts.items():
        if flag in given:
            have = getattr(old.options, field)
            if have is None or float(given[flag]) != float(have) if field in ("context", "batch", "prompt_cache_gb",
                                                                             "headroom_gb") \
                    else given[flag] != have:
                out.append(flag)
    if given.get("--path-map"):
        node, path = given["--path-map"].split("=", 1)
        if old.path_map.get(node) != path:
            out.append("--path-map")
    if "--nodes" in given and given["--nodes"].split(",") != [r.node for r in old.ranks]:
        out.append("--nodes")
    return out


def _one_error_line(w: World, r, code: int) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    w.check(len(lines) == 1 and "Traceback" not in r.stderr,
            f"exit {code} without exactly one error line:\n{r.stderr[-2000:]}")


def _options(w: World, rng: random.Random) -> tuple[list[str], dict]:
    """Random replan arguments (about a third of the options each time) and what was given, by field."""
    choices = {
        "--schedule": ["auto", "lockstep", "overlap"],
        "--prompt-cache-gb": ["0", "0.01", "0.03", "0.25"],
        "--headroom-gb": ["0.25", "0.5"],
        "--allocation": ["auto", "balanced", "proportional", "work", "speed"],
        "--parallel": ["auto", "pipeline", "tensor"],
        "--backend": ["auto", "ring", "mpi"],
        "--context": ["256", "512", "1024"],
        "--batch": ["1", "2", "4"],
        "--nodes": ["a,b", "b,a", "a,b,c", "c,a", "b"],
        "--path-map": ["", f"a={w.copy}", f"a={w.model}", f"b={w.copy}", f"b={w.missing}", f"a={w.missing}",
                       "a=relative/m"],
    }
    args, given = [], {}
    # mostly one option at a time (so each field's own effect is seen), sometimes several
    picked = set(rng.sample(sorted(choices), rng.choice([1, 1, 1, 2, 3])))
    for flag, values in choices.items():
        if flag in picked:
            v = rng.choice(values)
            if flag == "--path-map" and v:  # a path-map may only name nodes the new plan has
                nodes = given.get("--nodes", "a,b,c").split(",")
                if v.split("=", 1)[0] not in nodes:
                    continue
            args += [flag, v]
            given[flag] = v
    if ("--nodes" in given or "--allocation" in given) and rng.random() < 0.5 or rng.random() < 0.1:
        # node c can only join from a cluster file; speeds (for --allocation speed) only come from one
        c = str(rng.choice([w.cluster, w.measured]))
        args += ["-c", c]
        given["-c"] = c
    return args, given


def _step_replan(w: World, rng: random.Random) -> str:
    before = w.snapshot()
    hist = w.history()
    old = w.load(str(w.dep))
    if w.seen and rng.random() < 0.2:
        target = rng.choice(list(w.seen))  # in the order seen: ids hash tmp paths, their order is not fixed
        args, given = ["--to", target], {"--to": target}
    elif rng.random() < 0.1:
        args, given = [], {}
    else:
        args, given = _options(w, rng)
    r = w.cli("replan", str(w.dep), *args, "--yes", "--json")
    w.check(r.code in OK_CODES, f"replan exited {r.code}:\n{r.stderr[-2000:]}")
    if r.code:
        _one_error_line(w, r, r.code)
        w.check(w.snapshot() == before, f"a refused replan (exit {r.code}) changed files")
        if given.get("--path-map", "").endswith("=" + str(w.missing)) and r.code == 69:  # (else refused earlier)
            w.check(str(w.missing) in r.stderr and "does not exist" in r.stderr,
                    f"the missing path is not named:\n{r.stderr}")
        if given.get("--path-map") == "a=relative/m":
            w.check(r.code == 2, f"a relative --path-map exited {r.code}, not 2")
        return f"refused {r.code}"
    doc = r.json()
    new = w.load(str(w.dep))
    w.check(str(w.missing) not in json.dumps(new.path_map), "a path that does not exist reached the deployment")
    if doc["action"] == "unchanged" and doc["diff"]["records_changed"]:
        # only measurements differ (speeds): the record is rewritten in place, under the same id, nothing restarts
        w.check(doc["diff"]["records_changed"] == ["speeds"] and new.deployment_id == old.deployment_id
                and fingerprint(new) == fingerprint(old) and new.speeds != old.speeds,
                "a records-only replan changed more than the measurements")
        after = w.history()
        w.check(len(after) == len(hist) + 1 and after[-1]["from"] == after[-1]["to"] == old.deployment_id
                and "speeds updated" in after[-1]["changes"], "no history entry for updated speeds")
        return "records speeds"
    if doc["action"] == "unchanged":
        w.check(w.snapshot() == before and doc["new"] == doc["current"] == old.deployment_id,
                "an unchanged replan wrote something or named another deployment")
        w.check(not _asked_changes(old, given), f"unchanged, but {_asked_changes(old, given)} asked for a change")
        moved = [r for r in doc["diff"]["nodes"] if r["change"] != "same" or r["path_before"] != r["path_after"]]
        w.check(not moved and not doc["diff"]["other"],
                f"unchanged, but its own preview shows changes: {moved or doc['diff']['other']}")
        for f in RUN_FIELDS:
            w.check(getattr(new, f) == getattr(old, f), f"unchanged, but {f} differs")
        w.check([(x.node, x.start_layer, x.end_layer) for x in new.ranks]
                == [(x.node, x.start_layer, x.end_layer) for x in old.ranks], "unchanged, but the layers moved")
        return "unchanged"
    w.check(doc["action"] == "applied", f"action {doc['action']!r}")
    w.check(new.deployment_id == doc["new"] != old.deployment_id == doc["current"],
            f"applied, but the id did not change ({old.deployment_id} -> {new.deployment_id})")
    w.remember(new)
    after = w.history()
    w.check(len(after) == len(hist) + 1 and after[-1]["from"] == old.deployment_id
            and after[-1]["to"] == new.deployment_id and after[-1]["changes"], "no history entry for a change")
    w.check((w.state / "deployments" / f"{old.deployment_id}.json").read_bytes()
            == before.get(f"state/deployments/{old.deployment_id}.json",
                          (w.state / "deployments" / f"{old.deployment_id}.json").read_bytes()),
            "the old deployment's file was rewritten")
    if "--to" in given:
        w.check(w.dep.read_bytes() == (w.state / "deployments" / f"{given['--to']}.json").read_bytes()
                and new.deployment_id == given["--to"], "--to did not give back exactly that deployment")
        return f"back to {given['--to']}"
    # what was given is what the new deployment records (nothing silently dropped)
    fields = {"--schedule": "schedule", "--allocation": "allocation", "--parallel": "parallel",
              "--backend": "backend"}
    for flag, f in fields.items():
        if flag in given:
            w.check(getattr(new.options, f) == given[flag], f"{flag} {given[flag]} not recorded")
    if "--context" in given:
        w.check(new.options.context == int(given["--context"]), "--context not recorded")
    if "--batch" in given:
        w.check(new.batch == int(given["--batch"]), "--batch not planned")
    if "--prompt-cache-gb" in given:
        w.check(new.options.prompt_cache_gb == float(given["--prompt-cache-gb"]), "--prompt-cache-gb not recorded")
        w.check((new.prompt_cache_tokens == 0) == (float(given["--prompt-cache-gb"]) == 0),
                "the prompt cache is off although asked for, or on although 0")
    if "--path-map" in given and given["--path-map"]:
        node, path = given["--path-map"].split("=", 1)
        w.check(new.path_map[node] == path, "--path-map not recorded")
    return "applied " + ",".join(doc["diff"]["fields_changed"])


def walk(folder: Path, model: Path, rng: random.Random, steps: int) -> list[str]:
    """Plan, then ``steps`` random replans; raises AssertionError naming the broken invariant and the last
    commands. Returns one note per step."""
    w = World(folder, model)
    notes = []
    # plan: the default prompt cache and none are two deployments, and both files stay
    ids = []
    for extra in ([], ["--prompt-cache-gb", "0"]):
        r = w.cli("plan", "-c", str(w.cluster), "-m", str(model), "--context", "512",
                  "-o", str(w.dep), "--json", *extra)
        w.check(r.code == 0, f"plan exited {r.code}: {r.stderr}")
        ids.append(r.json()["deployment_id"])
        w.remember(w.load(str(w.dep)))
    w.check(ids[0] != ids[1], "plan --prompt-cache-gb 0 and the default share an id")
    w.check(all((w.state / "deployments" / f"{i}.json").exists() for i in ids), "a plan replaced another")
    for _ in range(steps):
        notes.append(_step_replan(w, rng))
        w.check_files()
    return notes
