"""Self-healing figures (issue 34): from a node's loss to serving again on the nodes left, and back to the
original plan once the node is healthy.

Run: .venv/bin/python bench/heal.py [--quick] [--cases a,b,...] [--heal-grace S] [--rejoin-after S]

Each case is real: `clusterctl launch --heal` (the supervisor, default policy unless told) over MLX ranks on this
machine ("local" nodes) or on network-namespace hosts with their own sshd (the link case), 2 clients sending
requests all along. The fault: the rank of the last node SIGKILLed, frozen with SIGSTOP, or that node's link cut
(`ip link set DEV down` in its namespace; restored once the heal is done). Measured:

  heal s     the fault -> the supervisor serving again on the nodes left (its state file says `serving` with a
             new job, which passed launch's canary), checked with a request on the same URL; "seen at": the
             fault -> the state file saying `healing` (detection and grace; the rest is teardown and relaunch)
  rejoin s   the node healthy again -> serving on the original plan again. A killed or frozen rank's node is
             healthy all along, but can only be judged once the heal took it out of the plan: from the heal;
             a cut link: from its restore
  clients    requests that completed / ended with an error / hung (no answer within 60 s): hung must be 0

Goals: heal <= 30 s (tiny model, 2 -> 1 node), <= 60 s (SmolLM2, 3 -> 2); rejoin <= 60 s; 0 hung; URL unchanged.
`--quick` runs the tiny-model SIGKILL case only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "launch"))

from _common import log, machine_note, model, say, table  # noqa: E402
from launchutil import cli, local_cluster, manifests, processes_with_nonce, wait_line  # noqa: E402

GOAL_HEAL = {"7m": 30.0, "smollm2": 60.0}
GOAL_REJOIN = 60.0
ASK_TIMEOUT = 60.0


class Skip(Exception):
    pass


@dataclass
class Case:
    name: str
    kind: str  # model: 7m | smollm2
    nodes: int
    fault: str  # sigkill | sigstop | link


CASES = [Case("tiny 2->1, rank SIGKILL", "7m", 2, "sigkill"),
         Case("tiny 2->1, rank frozen (SIGSTOP)", "7m", 2, "sigstop"),
         Case("tiny 2->1, link cut (netns)", "7m", 2, "link"),
         Case("SmolLM2 3->2, rank SIGKILL", "smollm2", 3, "sigkill")]


@dataclass
class Clients:
    """``n`` threads asking ``ask()`` in a loop until stopped: completed, errors, hung (no answer in time)."""

    ask: object
    n: int = 2
    counts: dict = field(default_factory=lambda: {"ok": 0, "error": 0, "hung": 0})

    def __post_init__(self):
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            what = self.ask()
            with self.lock:
                self.counts[what] += 1
            if what != "ok":
                time.sleep(0.2)

    def end(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(ASK_TIMEOUT + 10)
        return dict(self.counts)


def ask_local(endpoint: str) -> str:
    req = urllib.request.Request(endpoint + "/v1/completions", data=json.dumps(
        {"prompt": "hello", "max_tokens": 8, "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ASK_TIMEOUT) as r:
            json.loads(r.read())
            return "ok"
    except TimeoutError:
        return "hung"
    except urllib.error.URLError as e:
        return "hung" if isinstance(e.reason, TimeoutError) else "error"
    except (OSError, ValueError):
        return "error"


def ask_netns(cluster, endpoint: str) -> str:
    try:
        q = subprocess.run(["ip", "netns", "exec", cluster.nodes[0].netns, "curl", "-sf", "--max-time",
                            str(ASK_TIMEOUT), endpoint + "/v1/completions", "-H", "Content-Type: application/json",
                            "-d", json.dumps({"prompt": "hello", "max_tokens": 8, "temperature": 0})],
                           capture_output=True, text=True, timeout=ASK_TIMEOUT + 10)
    except subprocess.TimeoutExpired:
        return "hung"
    return "ok" if q.returncode == 0 else "hung" if q.returncode == 28 else "error"


def heal_state(state: Path, cluster: str) -> dict:
    try:
        return json.loads((state / "heal" / f"{cluster}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_state(state: Path, cluster: str, pred, timeout: float, what: str) -> float:
    """The monotonic time the supervisor's state file first satisfied ``pred``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(heal_state(state, cluster)):
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {timeout:g} s; state: {heal_state(state, cluster)}")


def _start(argv: list[str], env: dict, errlog: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errlog.open("w"), text=True,
                            env={**os.environ, **env}, stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _launch_local(d: Path, case: Case, extra: list[str]):
    env = {"CLUSTERCTL_STATE_DIR": str(d / "state")}
    dep = d / "dep.json"
    p = cli("plan", "-c", str(local_cluster(d, (6,) * case.nodes)), "-m", str(model(case.kind)), "--context", "512",
            "-o", str(dep), "-q", env=env)
    if p.returncode:
        raise RuntimeError(f"plan exited {p.returncode}: {p.stderr.strip()}")
    proc = _start([sys.executable, "-m", "clusterctl", "launch", str(dep), "--heal", "--timeout", "300", *extra],
                  env, d / "supervisor.log")
    return env, proc, "t", lambda endpoint: (lambda: ask_local(endpoint)), None


def _launch_netns(d: Path, case: Case, extra: list[str], bed):
    from test_launch_netns import ns_cli

    from faults import _ns_cluster_toml

    cluster = bed.build(case.nodes)
    env = {"CLUSTERCTL_STATE_DIR": str(d / "state"), "PYTHONPATH": ":".join(sys.path)}
    dep = d / "dep.json"
    r = ns_cli(cluster, env, "plan", "-c", str(_ns_cluster_toml(d, cluster, model(case.kind))), "-m",
               str(model(case.kind)), "--context", "512", "-o", str(dep), "-q")
    if r.returncode:
        raise RuntimeError(f"plan exited {r.returncode}: {r.stderr.strip()}")
    argv = cluster.exec_argv(["env", *[f"{k}={v}" for k, v in env.items()], sys.executable, "-m", "clusterctl",
                              "launch", str(dep), "--heal", "--timeout", "300", "--known-hosts",
                              str(cluster.known_hosts), *extra])
    proc = _start(argv, {}, d / "supervisor.log")
    return env, proc, "ns", lambda endpoint: (lambda: ask_netns(cluster, endpoint)), cluster


def _job(state: Path, job_id: str) -> dict:
    return next(m for m in manifests(state) if m["job_id"] == job_id)


def run_case(root: Path, case: Case, extra: list[str], bed=None) -> dict:
    """One case, start to end; the figures."""
    d = Path(tempfile.mkdtemp(prefix=case.fault + "-", dir=root))
    if case.fault == "link":
        env, proc, cname, asker, cluster = _launch_netns(d, case, extra, bed)
    else:
        env, proc, cname, asker, cluster = _launch_local(d, case, extra)
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    victim = None
    try:
        try:
            endpoint = wait_line(proc, 300)
        except (AssertionError, AttributeError):
            raise RuntimeError("launch --heal exited: " + (d / "supervisor.log").read_text()[-600:]) from None
        [m0] = manifests(state)
        original = heal_state(state, cname)["deployment"]
        victim = m0["ranks"][-1]
        clients = Clients(asker(endpoint))
        time.sleep(1.0)
        t0 = time.monotonic()
        if case.fault == "link":
            cluster.cut(cluster.nodes[-1])
        else:
            os.kill(victim["pid"], signal.SIGKILL if case.fault == "sigkill" else signal.SIGSTOP)
        t_detect = wait_state(state, cname, lambda s: s.get("state") != "serving", 300, "the loss seen")
        t_heal = wait_state(state, cname, lambda s: s.get("state") == "serving" and s.get("job") not in (
            None, m0["job_id"]) and s.get("deployment") != original, 300, "the heal")
        m1 = _job(state, heal_state(state, cname)["job"])  # the lost job's manifest stays while its node is cut
        healed_ok = asker(endpoint)() == "ok"
        if case.fault == "link":
            cluster.restore(cluster.nodes[-1])
        t_healthy = time.monotonic()
        t_back = wait_state(state, cname, lambda s: s.get("state") == "serving" and s.get("deployment") == original
                            and s.get("job") not in (None, m1["job_id"]), 300, "the rejoin")
        m2 = _job(state, heal_state(state, cname)["job"])
        back_ok = asker(endpoint)() == "ok"
        counts = clients.end()
        hist = json.loads(cli("history", "--json", env=env).stdout or "{}").get("clusters", [{}])[0]
        old_left = processes_with_nonce(m0["nonce"])
    finally:
        if case.fault == "link" and cluster is not None:
            cluster.restore(cluster.nodes[-1])
        if case.fault == "sigstop" and victim is not None:  # nothing of ours stays frozen
            with contextlib.suppress(OSError):
                os.kill(victim["pid"], signal.SIGCONT)
        code = _stop(proc)
    return {"case": case.name, "kind": case.kind, "heal_s": t_heal - t0, "detect_s": t_detect - t0,
            "rejoin_s": t_back - t_healthy,
            "clients": counts, "url_same": m1["endpoint"] == endpoint == m2["endpoint"],
            "served_after_heal": healed_ok, "served_after_rejoin": back_ok, "ranks": [len(m0["ranks"]),
            len(m1["ranks"]), len(m2["ranks"])], "kinds": [e.get("kind") for e in hist.get("entries", [])],
            "old_ranks_left": len(old_left), "exit": code, "heals": heal_state(state, cname).get("heals")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny-model SIGKILL case only")
    ap.add_argument("--cases", default="", help="comma-separated words; only cases whose name contains one run")
    ap.add_argument("--heal-grace", type=float, default=None)
    ap.add_argument("--rejoin-after", type=float, default=None)
    ns = ap.parse_args()
    extra = [*(["--heal-grace", str(ns.heal_grace)] if ns.heal_grace is not None else []),
             *(["--rejoin-after", str(ns.rejoin_after)] if ns.rejoin_after is not None else [])]
    words = [w.strip().lower() for w in ns.cases.split(",") if w.strip()]
    cases = CASES[:1] if ns.quick else [c for c in CASES if not words or any(w in c.name.lower() for w in words)]
    say(f"# bench/heal.py: {machine_note()}; policy flags: {' '.join(extra) or 'defaults'}")
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="heal-bench-", dir=REPO / "bench" / "out") as tmp:
        bed = None
        try:
            for case in cases:
                if case.fault == "link" and bed is None:
                    from fixtures_ssh import NetnsBed

                    why = NetnsBed.why_not()
                    if why:
                        rows.append([case.name, "skipped: " + why, "", "", "", "", ""])
                        continue
                    bed = NetnsBed(Path(tmp) / "netns")
                log(f"{case.name} ...")
                try:
                    r = run_case(Path(tmp), case, extra, bed)
                except Exception as e:  # a case that breaks says why; the others still run
                    ok = False
                    for f in Path(tmp).glob("*/supervisor.log"):
                        log(f"{f}: ...{f.read_text(errors='replace')[-1500:]}")
                    rows.append([case.name, f"FAILED: {e}"[:200], "", "", "", "", ""])
                    continue
                log(json.dumps(r))
                good = (r["heal_s"] <= GOAL_HEAL[r["kind"]] and r["rejoin_s"] <= GOAL_REJOIN
                        and r["clients"]["hung"] == 0 and r["url_same"] and r["served_after_heal"]
                        and r["served_after_rejoin"] and r["old_ranks_left"] == 0)
                ok &= good
                c = r["clients"]
                rows.append([case.name, f"{r['heal_s']:.1f} ({r['heal_s'] / GOAL_HEAL[r['kind']]:.2f}x goal; "
                             f"seen at {r['detect_s']:.1f})",
                             f"{r['rejoin_s']:.1f} ({r['rejoin_s'] / GOAL_REJOIN:.2f}x goal)",
                             f"{c['ok']}/{c['error']}/{c['hung']}", "yes" if r["url_same"] else "NO",
                             "->".join(map(str, r["ranks"])) + " " + ",".join(map(str, r["kinds"])),
                             "pass" if good else "FAIL"])
        finally:
            if bed is not None:
                bed.close()
    say(table(rows, ["case", "heal s", "rejoin s", "clients ok/error/hung", "same URL", "ranks, history",
                     "goals"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
