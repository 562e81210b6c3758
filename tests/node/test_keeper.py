"""The keeper on its own: real processes, real signals, real pipes (no SSH needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from clusterctl.node import keeper
from procstate import running

PY = sys.executable


def spawn(argv: list[str], *, grace: float = 1.0, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "clusterctl.node.keeper", "--grace", str(grace), "--", *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})}, **kw)


def report(k: subprocess.Popen) -> dict:
    line = k.stdout.readline()
    assert line, k.stderr.read()
    return json.loads(line)


def wait_dead(pgid: int, timeout: float = 8.0) -> float:
    t0 = time.monotonic()
    while keeper.group_alive(pgid):
        assert time.monotonic() - t0 < timeout, f"group {pgid} still alive"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_report_identifies_the_child():
    k = spawn(["sleep", "30"])
    info = report(k)
    assert set(info) == {"pid", "pgid", "start_time", "boot_id"}
    child = psutil.Process(info["pid"])
    assert child.ppid() == k.pid and os.getpgid(info["pid"]) == info["pgid"] == info["pid"]
    assert os.getsid(info["pid"]) == info["pid"], "the child must lead its own session"
    assert info["start_time"] == child.create_time() == keeper.process_start_time(info["pid"])
    if sys.platform.startswith("linux"):
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert info["boot_id"] == f.read().strip()
    k.stdin.close()
    assert k.wait(10) == 128 + signal.SIGTERM
    assert keeper.process_start_time(info["pid"]) is None


def test_forwards_output_and_exit_status():
    k = spawn(["sh", "-c", "echo out; echo err >&2; exit 7"])
    out, err = k.communicate(timeout=10)
    first, rest = out.split(b"\n", 1)
    assert json.loads(first)["pid"] > 0
    assert rest == b"out\n" and err == b"err\n" and k.returncode == 7


def test_signal_death_maps_to_128_plus_n():
    k = spawn(["sh", "-c", "kill -KILL $$"])
    k.communicate(timeout=10)
    assert k.returncode == 128 + signal.SIGKILL


def test_unstartable_command():
    k = spawn(["/nonexistent/binary"])
    out, err = k.communicate(timeout=10)
    assert k.returncode == 127 and out == b"" and b"cannot start" in err


def test_stdin_eof_terms_the_whole_group():
    # The child starts a grandchild in the same group; both must go.
    k = spawn(["sh", "-c", "sleep 60 & echo $!; wait"], grace=30)
    info = report(k)
    grandchild = int(k.stdout.readline())
    assert os.getpgid(grandchild) == info["pgid"]
    t0 = time.monotonic()
    k.stdin.close()
    assert k.wait(10) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 10, "a child that obeys SIGTERM must not wait out the grace"
    wait_dead(info["pgid"], 2)


def test_sigterm_ignored_means_sigkill_after_the_grace():
    k = spawn(["sh", "-c", "trap '' TERM; echo up; while :; do sleep 1; done"], grace=1.0)
    info = report(k)
    assert k.stdout.readline() == b"up\n"
    t0 = time.monotonic()
    k.stdin.close()
    assert k.wait(10) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 >= 1.0
    wait_dead(info["pgid"], 2)


def test_stopped_child_gets_sigcont_with_sigterm():
    k = spawn(["sleep", "60"], grace=30)
    info = report(k)
    os.kill(info["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    k.stdin.close()
    assert k.wait(20) == 128 + signal.SIGTERM  # TERM, not the KILL after 30 s
    assert time.monotonic() - t0 < 10


def test_kill_line_skips_the_grace():
    k = spawn(["sh", "-c", "trap '' TERM; sleep 60"], grace=60)
    info = report(k)
    t0 = time.monotonic()
    k.stdin.write(b"kill\n")
    k.stdin.flush()
    assert k.wait(20) == 128 + signal.SIGKILL and time.monotonic() - t0 < 10
    wait_dead(info["pgid"], 2)


def test_keeper_sigterm_stops_and_sigint_is_ignored():
    k = spawn(["sleep", "60"], grace=5)
    info = report(k)
    k.send_signal(signal.SIGINT)  # Ctrl-C in the coordinator's terminal must not orphan the child
    time.sleep(0.5)
    assert k.poll() is None and keeper.group_alive(info["pgid"])
    k.send_signal(signal.SIGTERM)
    assert k.wait(10) == 128 + signal.SIGTERM
    wait_dead(info["pgid"], 2)


def test_parent_death_stops_the_child_even_with_stdin_open():
    # The keeper's stdin comes from a pipe this test keeps open; only its parent dies.
    r, w = os.pipe()
    parent = subprocess.Popen(
        [PY, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)",
         PY, "-m", "clusterctl.node.keeper", "--grace", "1", "--", "sleep", "60"],
        stdin=r, stdout=subprocess.PIPE)
    os.close(r)
    try:
        info = json.loads(parent.stdout.readline())
        assert keeper.group_alive(info["pgid"])
        parent.kill()
        parent.wait()
        wait_dead(info["pgid"], 8)
    finally:
        os.close(w)
        if parent.poll() is None:
            parent.kill()


def test_leftovers_of_a_child_that_exited_are_stopped():
    k = spawn(["sh", "-c", "sleep 60 & echo $!; exit 0"], grace=1)
    info = report(k)
    grandchild = int(k.stdout.readline())
    assert k.wait(10) == 0
    wait_dead(info["pgid"], 2)
    assert not running(grandchild)


def test_grace_from_env_and_not_leaked_to_the_child():
    k = subprocess.Popen([PY, "-m", "clusterctl.node.keeper", "--", "sh", "-c",
                          "trap '' TERM; echo ${CLUSTERCTL_KEEPER_GRACE:-unset}; sleep 60"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, keeper.GRACE_ENV: "0.5"})
    report(k)
    assert k.stdout.readline() == b"unset\n"
    t0 = time.monotonic()
    k.stdin.close()
    assert k.wait(20) == 128 + signal.SIGKILL and time.monotonic() - t0 < 8  # 0.5 s, not the default 10 s


def test_broken_output_channel_does_not_block_the_child(tmp_path):
    # Once the coordinator stops reading, the keeper keeps draining the child so it can still finish.
    done = tmp_path / "done"
    k = spawn([PY, "-c", f"import sys\nfor _ in range(2000): sys.stdout.write('y' * 1000 + '\\n')\n"
               f"open({str(done)!r}, 'w').close()\nimport time; time.sleep(60)"], grace=1)
    report(k)
    k.stdout.close()
    deadline = time.monotonic() + 10
    while not done.exists():
        assert time.monotonic() < deadline, "the child blocked on a full pipe"
        time.sleep(0.05)
    k.stdin.close()
    assert k.wait(10) in (128 + signal.SIGTERM, 128 + signal.SIGKILL)


def test_usage_error_without_a_command():
    r = subprocess.run([PY, "-m", "clusterctl.node.keeper", "--grace", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "no command" in r.stderr


def test_kill_group_if_same_checks_identity():
    k = spawn(["sleep", "60"], grace=30)
    info = report(k)
    boot = keeper.boot_id()
    assert not keeper.kill_group_if_same(info["pid"], info["pgid"], info["start_time"] + 0.01, boot)
    assert not keeper.kill_group_if_same(info["pid"], info["pgid"], None, boot)
    if boot is not None:
        assert not keeper.kill_group_if_same(info["pid"], info["pgid"], info["start_time"], "another-boot")
    assert keeper.group_alive(info["pgid"]), "a mismatched identity must never be signalled"
    assert keeper.kill_group_if_same(info["pid"], info["pgid"], info["start_time"], boot)
    assert k.wait(10) == 128 + signal.SIGKILL
    wait_dead(info["pgid"], 2)
