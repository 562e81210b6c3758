"""Benchmark (issue 12): an applied replan vs the manual way, and the unchanged short-circuit, in one run.

Run: .venv/bin/python bench/replan.py [--repeats N]

A 2-node local cluster (memory_gb 2 and 6) serving the 7M tiny model, detached. Each repeat, interleaved and
rotated:
  replan     `clusterctl replan dep.json --allocation X --yes` (X toggles balanced <-> proportional): the idle
             check, verified teardown, swap, relaunch to ready (canary passed) -> command returned
  manual     what a script does by hand for the same change: `clusterctl teardown`, `clusterctl plan ... -o
             dep.json --allocation X`, `clusterctl launch dep.json --detach` -> last command returned
  unchanged  `clusterctl replan dep.json --path-map a=P --yes` with P toggling between two copies of the model
             (same plan_hash, another record): the file is rewritten, no process restarts (pids checked)
  nothing    `clusterctl replan dep.json` when nothing differs (exit 0, nothing written)
Goals: replan <= 1.0x manual; unchanged < 1 s with no process restarted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check, clusterctl, fmt, launch_manifests, machine_note, med, model, ratio, say, table  # noqa: E402


def write_cluster(root: Path) -> Path:
    lines = ["[cluster]", 'name = "rb"']
    for name, mem in (("a", 2), ("b", 6)):
        lines += ["[[node]]", f'name = "{name}"', "local = true", f"memory_gb = {mem}",
                  f'runtime_dir = "{root}/run-{name}"']
    p = root / "cluster.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def pids(state: Path) -> list[int]:
    return sorted(r["pid"] for m in launch_manifests(state) for r in m["ranks"])


def timed(*argv: str, env: dict) -> float:
    t = time.monotonic()
    check(clusterctl(*argv, env=env, timeout=600), " ".join(argv[:2]))
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ns = ap.parse_args()
    say(f"bench/replan.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  repeats={ns.repeats}")
    root = Path(tempfile.mkdtemp(prefix="cct-bench-replan-"))
    state = root / "state"
    env = {"CLUSTERCTL_STATE_DIR": str(state)}
    res: dict[str, list[float]] = {"replan": [], "manual": [], "unchanged": [], "nothing": []}
    restarted = 0
    try:
        m = model("7m")
        copies = [root / "copy1", root / "copy2"]
        for c in copies:
            shutil.copytree(m, c)
        cluster = write_cluster(root)
        dep = root / "dep.json"
        alloc = "proportional"
        check(clusterctl("plan", "-c", str(cluster), "-m", str(m), "--allocation", alloc, "--context", "512",
                         "-o", str(dep), "-q", env=env), "plan")
        check(clusterctl("launch", str(dep), "--detach", "-q", env=env, timeout=600), "launch")
        for rep in range(ns.repeats):
            for arm in (("replan", "manual") if rep % 2 == 0 else ("manual", "replan")):
                alloc = "balanced" if alloc == "proportional" else "proportional"
                if arm == "replan":
                    res[arm].append(timed("replan", str(dep), "--allocation", alloc, "--yes", "-q", env=env))
                else:
                    t = time.monotonic()
                    check(clusterctl("teardown", "-q", env=env), "teardown")
                    check(clusterctl("plan", "-c", str(cluster), "-m", str(m), "--allocation", alloc, "--context",
                                     "512", "-o", str(dep), "-q", env=env), "plan")
                    check(clusterctl("launch", str(dep), "--detach", "-q", env=env, timeout=600), "launch")
                    res[arm].append(time.monotonic() - t)
            before = pids(state)
            res["unchanged"].append(timed("replan", str(dep), "--path-map", f"a={copies[rep % 2]}", "--yes", "-q",
                                          env=env))
            res["nothing"].append(timed("replan", str(dep), "-q", env=env))
            restarted += pids(state) != before
            say(f"  rep {rep + 1}: replan {fmt(res['replan'][-1])} s, manual {fmt(res['manual'][-1])} s, "
                f"unchanged {fmt(res['unchanged'][-1])} s, nothing {fmt(res['nothing'][-1])} s")
        clusterctl("teardown", "--force", "-q", env=env)
    finally:
        clusterctl("teardown", "--force", "-q", env=env)
        shutil.rmtree(root, ignore_errors=True)
    rows = [[k, fmt(med(v)), f"{min(v):.2f}-{max(v):.2f}" if v else "n/a", str(len(v))] for k, v in res.items()]
    say(table(rows, ["arm", "median s", "range", "runs"]))
    say(f"applied replan / manual teardown+plan+launch = {ratio(med(res['replan']), med(res['manual']))} "
        f"(goal <= 1.0x)")
    say(f"unchanged short-circuit: median {fmt(med(res['unchanged']))} s (goal < 1 s); runs where a rank process "
        f"changed: {restarted} of {ns.repeats} (goal 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
