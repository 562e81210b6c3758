"""Benchmark (issue 8): manifest hashing vs sha256sum, and an incremental `clusterctl sync` vs a full rsync.

Run: .venv/bin/python bench/sync.py [--quick] [--rounds N] [--size-mb M]   (the sync part needs root and sshd)

Hashing, on a model-like folder (4 shards of M/4 MiB of random bytes + small files), arms interleaved, the order
rotating every round:
  sha256sum          `sha256sum FILES` (coreutils, one process: the reference of the goal, >= 0.9x its speed)
  sha256sum -P       `xargs -P <cores> -n1 sha256sum` (several files at once, for information)
  manifest           `clusterctl manifest --no-cache DIR` (a whole process: start-up, walk, threaded hashing)
  manifest cached    `clusterctl manifest DIR` with the hash cache filled: nothing is read
Each arm runs twice per round: "warm" (files in the page cache: measures hashing) and "cold" (every file evicted
with POSIX_FADV_DONTNEED first, and checked with mincore: measures disk + hashing).

Sync, to one node over a real sshd on 127.0.0.1 (the model: the 7M tiny model + the same 4 shards):
  full rsync         `rsync -a -e <ssh_policy's ssh> SRC/ node:FRESH/` into an empty folder (what an operator
                     without clusterctl runs the first time, and after any change without a manifest)
  rsync -a again     the same command after one shard changed (rsync's own quick check, for information)
  clusterctl sync    `clusterctl sync DEP` after one shard changed: node survey, send that file, re-hash it there
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, SshNodes, fmt, machine_note, med, model, ratio, say, table  # noqa: E402

CLUSTERCTL = [PY, "-m", "clusterctl"]


def timed(argv, env=None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return dt


def evict(files: list[Path]) -> bool:
    """Drop the files from the page cache (retried); True when mincore confirms no page is left."""
    from clusterctl.ple.residency import file_pages

    for f in files:
        for _ in range(20):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if not file_pages(f).any():
                break
            time.sleep(0.01)
        else:
            return False
    return True


def make_shards(folder: Path, total_mb: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(4):
        p = folder / f"extra-{i + 1:05d}-of-00004.bin"
        with open(p, "wb") as f:
            for _ in range(total_mb // 4):
                f.write(os.urandom(1 << 20))
        out.append(p)
    return out


def bench_hashing(root: Path, size_mb: int, rounds: int) -> list[list[str]]:
    folder = root / "hash-model"
    files = make_shards(folder, size_mb)
    (folder / "config.json").write_text("{}")
    cache = root / "hash-cache"
    env = {"CLUSTERCTL_CACHE_DIR": str(cache)}
    subprocess.run([*CLUSTERCTL, "manifest", str(folder)], env={**os.environ, **env}, capture_output=True, check=True)
    names = [str(f) for f in sorted(folder.iterdir())]
    arms = {
        "sha256sum": lambda: timed(["sha256sum", *names]),
        "sha256sum -P": lambda: timed(["sh", "-c", f"printf '%s\\n' \"$@\" | xargs -P {os.cpu_count()} -n1 sha256sum",
                                       "sh", *names]),
        "manifest": lambda: timed([*CLUSTERCTL, "manifest", "--no-cache", str(folder)], env),
        "manifest cached": lambda: timed([*CLUSTERCTL, "manifest", str(folder)], env),
    }
    results: dict[tuple[str, str], list[float]] = {}
    cold_ok = True
    order = list(arms)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            for temp in ("warm", "cold"):
                if temp == "cold":
                    cold_ok &= evict(files)
                else:
                    subprocess.run(["cat", *names], stdout=subprocess.DEVNULL, check=True)
                results.setdefault((name, temp), []).append(arms[name]())
    total = sum(f.stat().st_size for f in folder.iterdir())
    rows = []
    for temp in ("warm", "cold"):
        ref = med(results[("sha256sum", temp)])
        for name in arms:
            t = med(results[(name, temp)])
            speed = "(reads nothing)" if name == "manifest cached" else f"{total / t / 2**20:.0f} MiB/s"
            rows.append([temp, name, fmt(t, " s", 3), speed, ratio(ref, t)])
    if not cold_ok:
        say("  note: eviction could not be verified for every file; the cold rows may be partly warm")
    return rows


def bench_big_cached(root: Path, gib: int) -> list[list[str]]:
    """A second `clusterctl manifest` over an unchanged ``gib`` GiB model (sparse shards: hashed once, at full
    speed, then answered from the cache)."""
    folder = root / "big-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    n = max(1, gib // 4)  # shards of about 4 GiB, like a hub model's
    for i in range(n):
        with open(folder / f"model-{i + 1:05d}-of-{n:05d}.safetensors", "wb") as f:
            f.truncate((gib << 30) // n)
    env = {"CLUSTERCTL_CACHE_DIR": str(root / "big-cache")}
    first = timed([*CLUSTERCTL, "manifest", str(folder)], env)
    second = [timed([*CLUSTERCTL, "manifest", str(folder)], env) for _ in range(3)]
    return [[f"{gib} GiB, first run (hashes)", fmt(first, " s", 2)],
            [f"{gib} GiB, second run (cache), median of 3", fmt(med(second), " s", 3)]]


def bench_sync(root: Path, size_mb: int, rounds: int) -> list[list[str]]:
    from clusterctl.connect import ssh_policy

    nodes = SshNodes.start(root / "sshd", 1)
    try:
        d = nodes.daemons[0]
        src = root / "sync-model"
        shutil.copytree(model("7m"), src)
        shards = make_shards(src, size_mb)
        dest = root / "node-copy"
        cluster = root / "cluster.toml"
        cluster.write_text(f"""[cluster]
name = "bench-sync"
[[node]]
name = "b"
host = "127.0.0.1"
port = {d.port}
user = "root"
identity_file = "{nodes.client_key}"
memory_gb = 8
python = "{PY}"
model_path = "{dest}"
""")
        env = {"CLUSTERCTL_STATE_DIR": str(root / "state"), "CLUSTERCTL_CACHE_DIR": str(root / "cache")}
        dep = root / "dep.json"
        timed([*CLUSTERCTL, "plan", "-c", str(cluster), "-m", str(src), "-o", str(dep), "-q"], env)
        kh = ["--known-hosts", str(nodes.known_hosts)]
        timed([*CLUSTERCTL, "sync", str(dep), *kh], env)  # the node holds the model from here on
        target = d.target()
        rsh = ssh_policy.rsync_rsh(target)
        full, again, ours = [], [], []
        for r in range(rounds):
            fresh = root / f"fresh-{r}"
            full.append(timed(["rsync", "-a", "-e", rsh, "--", f"{src}/",
                               ssh_policy.rsync_remote_operand(target, f"{fresh}/")], ssh_policy.RSYNC_ENV))
            shutil.rmtree(fresh)
            changed = shards[r % len(shards)]
            with open(changed, "r+b") as f:  # one shard changes (a re-quantized or re-downloaded file)
                f.write(os.urandom(1 << 20))
            if r % 2 == 0:
                ours.append(timed([*CLUSTERCTL, "sync", str(dep), *kh], env))
                again.append(timed(["rsync", "-a", "-e", rsh, "--", f"{src}/",
                                    ssh_policy.rsync_remote_operand(target, f"{root / 'rsync-copy'}/")],
                                   ssh_policy.RSYNC_ENV))
            else:
                again.append(timed(["rsync", "-a", "-e", rsh, "--", f"{src}/",
                                    ssh_policy.rsync_remote_operand(target, f"{root / 'rsync-copy'}/")],
                                   ssh_policy.RSYNC_ENV))
                ours.append(timed([*CLUSTERCTL, "sync", str(dep), *kh], env))
        check = subprocess.run([*CLUSTERCTL, "sync", str(dep), "--dry-run", "--json", *kh], capture_output=True,
                               text=True, env={**os.environ, **env})
        states = {e["node"]: e["state"] for e in map(json.loads, check.stdout.splitlines()) if e["event"] == "status"}
        assert states == {"b": "ok"}, states
        total = sum(p.stat().st_size for p in src.iterdir())
        ref = med(full)
        return [["full rsync (empty destination)", fmt(ref, " s", 3), f"{total / 2**20:.0f} MiB", "1.00x"],
                ["rsync -a after one change", fmt(med(again), " s", 3), "1 shard", ratio(ref, med(again))],
                ["clusterctl sync after one change", fmt(med(ours), " s", 3), "1 shard (verified on the node)",
                 ratio(ref, med(ours))]]
    finally:
        nodes.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB and 2 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--size-mb", type=int, default=None, help="total size of the 4 shards (default 1024)")
    ap.add_argument("--big-gb", type=int, default=None, help="size of the cached-run model (default 10, --quick 0)")
    a = ap.parse_args()
    big = a.big_gb if a.big_gb is not None else (0 if a.quick else 10)
    rounds = a.rounds or (2 if a.quick else 5)
    size = a.size_mb or (256 if a.quick else 1024)
    root = Path(tempfile.mkdtemp(prefix="bench-sync-", dir=REPO / "bench" / "out" if (REPO / "bench" / "out").is_dir()
                                 else None))
    try:
        say(f"bench/sync.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds {rounds}  shards {size} MiB")
        say("\nmanifest hashing (median of the rounds; speed = bytes / time; ratio = sha256sum time / arm time)")
        say(table(bench_hashing(root, size, rounds), ["cache", "arm", "time", "speed", "vs sha256sum"]))
        if big:
            say(f"\nan unchanged {big} GiB model, hashed once then from the cache (goal: second run < 1 s)")
            say(table(bench_big_cached(root, big), ["run", "time"]))
        if os.geteuid() == 0 and Path("/usr/sbin/sshd").exists():
            say("\nsync to one node over ssh (median; ratio = full rsync time / arm time)")
            say(table(bench_sync(root, size, rounds), ["arm", "time", "sent", "vs full rsync"]))
        else:
            say("\nsync: skipped (needs root and /usr/sbin/sshd)")
        say(f"\n{machine_note()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
