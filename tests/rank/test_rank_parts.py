"""The rank's pieces without starting a rank: spec validation, environment, markers, lease, stop strings, the idle
schedule and its wake-ups."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from clusterctl.errors import IntegrityError
from clusterctl.rank.markers import (Lease, Marker, MarkerMissing, MarkerWriter, read_lease, read_marker,
                                       write_lease, write_marker)
from clusterctl.rank.engine.generation import GenRequest, GenResult, Seq, StopMatcher
from clusterctl.rank.engine.loading import rank_environment
from clusterctl.protocol.rankspec import MLX_ENV_DEFAULTS
from clusterctl.protocol.rankspec import layer_range, parse_rank_spec
from clusterctl.rank.engine.requestqueue import ApiRequest, RequestQueue
from clusterctl.rank.engine.schedule import IDLE_WAKEABLE_S, MAX_CHECKPOINT, Cadence, IdleWait, idle_interval
from clusterctl.rank.watchdog import KEEPER_PID_ENV, LeaseWatch, ParentGone, Watchdog, peer_loss


def spec_dict(**kw) -> dict:
    d = dict(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=2, model_path="/m",
             start_layer=2, end_layer=8, layer_counts=[6, 2], num_layers=8, hostfile="/h.json", http_port=8000,
             runtime_dir="/r", marker_path="/r/m.json", gate_path="/r/gate")
    d.update(kw)
    return d


# ---- RankSpec

def test_layer_ranges_follow_mlx_lm_reversed_order():
    assert [layer_range([6, 2], r) for r in range(2)] == [(2, 8), (0, 2)]
    assert [layer_range([1, 5, 2], r) for r in range(3)] == [(7, 8), (2, 7), (0, 2)]
    spec = parse_rank_spec(spec_dict())
    assert spec.mlx_split == [6, 2]
    parse_rank_spec(spec_dict(rank=1, start_layer=0, end_layer=2, http_port=None))


def test_a_spec_without_every_ranks_count_takes_exactly_the_ranges_mlx_lm_can_give():
    """Launch's contracts carry a rank's own range, not every rank's count (issue 41 item 8: a list of N in each
    of N contracts, and a walk of it per rank). Every range some split gives is taken, no other, and the split
    rebuilt for mlx-lm's pipeline() places the rank exactly there."""
    import itertools

    for world in range(1, 5):
        for layers in range(world, 8):
            splits = [c for c in itertools.product(range(1, layers + 1), repeat=world) if sum(c) == layers]
            for r in range(world):
                possible = {layer_range(list(c), r) for c in splits}
                for start in range(layers):
                    for end in range(start + 1, layers + 1):
                        kw = dict(world_size=world, rank=r, start_layer=start, end_layer=end, num_layers=layers,
                                  layer_counts=None, hostfile="/h.json" if world > 1 else None)
                        if (start, end) not in possible:
                            with pytest.raises(IntegrityError, match="pipeline order"):
                                parse_rank_spec(spec_dict(**kw))
                            continue
                        split = parse_rank_spec(spec_dict(**kw)).mlx_split
                        assert len(split) == world and min(split) >= 1 and sum(split) == layers
                        assert layer_range(split, r) == (start, end)


@pytest.mark.parametrize("bad, words", [
    (dict(start_layer=0, end_layer=6), "pipeline order"),
    (dict(layer_counts=[6, 1]), "sum to 8"),
    (dict(layer_counts=[8, 0]), "positive"),
    (dict(world_size=1, layer_counts=[8], start_layer=0), "no hostfile"),
    (dict(hostfile=None), "needs a hostfile"),
    (dict(http_port=None), "http_port"),
    (dict(env={"MLX_RANK": "1"}), "MLX_RANK"),
    (dict(rank=2), "outside"),
    (dict(surprise=1), "surprise"),
    (dict(schema_version=2), "schema_version"),
])
def test_bad_specs_are_integrity_errors(bad, words):
    with pytest.raises(IntegrityError, match=words):
        parse_rank_spec(spec_dict(**bad))


def test_an_invalid_spec_never_echoes_the_api_key():
    with pytest.raises(IntegrityError) as e:
        parse_rank_spec(spec_dict(api_key="sk-very-secret", http_port="not a port"))
    assert "sk-very-secret" not in str(e.value)
    spec = parse_rank_spec(spec_dict(api_key="sk-very-secret"))
    assert "sk-very-secret" not in repr(spec) and spec.api_key_value() == "sk-very-secret"


# ---- environment

def test_env_defaults_yield_to_the_operator_and_the_contract_fixes_rank_and_hostfile():
    spec = parse_rank_spec(spec_dict(env={"JACCL_TIMEOUT_ACTION": "abort"}))
    env = rank_environment(spec, {"MLX_MAX_OPS_PER_BUFFER": "7", "MLX_RANK": "5", "PATH": "/bin"})
    assert env["MLX_MAX_OPS_PER_BUFFER"] == "7"  # operator's process env wins over our default
    assert env["JACCL_TIMEOUT_ACTION"] == "abort"  # contract env wins too
    assert env["MLX_MAX_MB_PER_BUFFER"] == MLX_ENV_DEFAULTS["MLX_MAX_MB_PER_BUFFER"]
    assert env["JACCL_PROGRESS_TIMEOUT_MS"] == "30000"
    assert (env["MLX_RANK"], env["MLX_HOSTFILE"], env["PATH"]) == ("0", "/h.json", "/bin")


def test_a_world_of_one_gets_no_hostfile_even_if_the_environment_has_one():
    spec = parse_rank_spec(spec_dict(world_size=1, layer_counts=[8], start_layer=0, hostfile=None))
    env = rank_environment(spec, {"MLX_HOSTFILE": "/stale.json", "MLX_RANK": "3"})
    assert "MLX_HOSTFILE" not in env and "MLX_RANK" not in env


def test_the_rank_loads_no_mlx_before_its_environment_is_final():
    """runtime.py fixes the environment (loading.py) before mlx is first imported: what it imports at its top,
    loading.py and group.py among them, loads no mlx."""
    import subprocess
    import sys

    code = ("import sys, clusterctl.rank.runtime, clusterctl.rank.engine.loading, clusterctl.rank.engine.group; "
            "print(sorted(m for m in ('mlx', 'mlx_lm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- markers

def _marker(**kw) -> Marker:
    d = dict(deployment_id="d", job_id="j", nonce="n", rank=0, node="a", host="h", pid=1, pgid=1,
             start_time=1.0, boot_id=None, state="ready", heartbeat_at=2.0)
    d.update(kw)
    return Marker(**d)


def test_marker_roundtrip_and_careful_reads(tmp_path):
    p = tmp_path / "m.json"
    write_marker(p, _marker(active_requests=["cmpl-1"]))
    assert read_marker(p).active_requests == ["cmpl-1"]
    with pytest.raises(MarkerMissing):
        read_marker(tmp_path / "absent.json")
    assert issubclass(MarkerMissing, IntegrityError)
    full = p.read_bytes()
    (tmp_path / "trunc.json").write_bytes(full[: len(full) // 2])
    (tmp_path / "foreign.json").write_text(json.dumps({"type": "lease", "seq": 1}))
    (tmp_path / "newer.json").write_text(json.dumps({**json.loads(full), "schema_version": 2}))
    (tmp_path / "big.json").write_bytes(b" " * (65 * 1024))
    (tmp_path / "list.json").write_text("[1, 2]")
    os.symlink(p, tmp_path / "link.json")
    for name, words in [("trunc", "not valid JSON"), ("foreign", "not a rank marker"), ("newer", "newer"),
                        ("big", "too large"), ("list", "not a JSON object"), ("link", "cannot open")]:
        with pytest.raises(IntegrityError, match=words):
            read_marker(tmp_path / f"{name}.json")


def test_marker_writer_heartbeats_and_states_only_move_forward(tmp_path):
    w = MarkerWriter(tmp_path / "m.json", deployment_id="d", job_id="j", nonce="n", rank=1, node="a",
                     interval=0.1)
    w.start()
    try:
        first = read_marker(w.path)
        assert (first.pid, first.pgid, first.state) == (os.getpid(), os.getpgid(0), "loading")
        assert first.start_time > 0
        time.sleep(0.35)
        assert read_marker(w.path).heartbeat_at > first.heartbeat_at
        w.update(state="stopping")
        w.update(state="serving")
        assert read_marker(w.path).state == "stopping"
        w.update(state="failed", error="boom", final=True)
        w.update(state="stopping", error=None)
        m = read_marker(w.path)
        assert (m.state, m.error) == ("failed", "boom")
    finally:
        w.stop()


def test_an_idle_marker_beats_at_its_idle_interval_and_a_busy_one_at_its_interval(tmp_path):
    """No request held: the heartbeat (a JSON dump and an atomic write, half of what an idle rank costs) comes
    every idle_interval; holding one: every interval, so the step notes stay fresh."""
    for held in ([], ["r1"]):
        w = MarkerWriter(tmp_path / f"m{len(held)}.json", deployment_id="d", job_id="j", nonce="n", rank=1,
                         node="a", interval=0.05, idle_interval=30.0)
        w.note(active_requests=held)
        w.start()
        try:
            first = read_marker(w.path).heartbeat_at
            time.sleep(0.5)
            beat = read_marker(w.path).heartbeat_at > first
            assert beat == bool(held), (held, beat)
        finally:
            w.stop()


def test_an_idle_rank_0_looks_at_its_cancel_file_often_at_first_then_four_times_a_second():
    looks = {}
    for idle_for in (0.0, 60.0):
        n = []
        IdleWait(call=lambda seq: None, check=lambda: n.append(1) and False).wait(1.0, seq=1, idle_for=idle_for)
        looks[idle_for] = len(n)
    assert looks[60.0] <= 1.0 / IdleWait.CHECK_IDLE_S + 1 < 8 <= looks[0.0], looks


def test_the_watchdog_trips_when_an_armed_deadline_passes_not_an_interval_later():
    tripped = threading.Event()
    dog = Watchdog(rank=0, on_trip=lambda e: tripped.set(), lease_path=None, lease_seconds=30, interval=30.0)
    with dog.guard(0.2, "an exchange"):
        dog.start()
        try:
            assert tripped.wait(10), "the deadline was judged only at the next interval"
        finally:
            dog.stop()


# ---- lease, judged on our own monotonic clock

def test_a_lease_that_never_appeared_is_not_stale(tmp_path):
    w = LeaseWatch(tmp_path / "job.lease", 0.2)
    time.sleep(0.3)
    assert w.check() is None


def test_a_lease_is_stale_only_when_seq_stops_changing(tmp_path):
    lease = tmp_path / "job.lease"
    w = LeaseWatch(lease, 5.0)
    for seq in range(4):
        write_lease(lease, Lease(holder="op", seq=seq, duration_s=0.3))
        os.utime(lease, (0, 0))  # a wall-clock date from 1970 must not matter
        assert w.check() is None
        time.sleep(0.15)
    assert w.check() is None
    time.sleep(0.35)
    reason = w.check()
    assert reason and "not renewed" in reason and "holder op" in reason
    assert read_lease(lease).seq == 3


def test_a_vanished_lease_counts_as_not_renewed_and_the_contract_caps_the_duration(tmp_path):
    lease = tmp_path / "job.lease"
    write_lease(lease, Lease(holder="op", seq=1, duration_s=3600))
    w = LeaseWatch(lease, 0.2)
    assert w.check() is None
    lease.unlink()
    time.sleep(0.3)
    assert "limit 0.2 s" in w.check()


def test_peer_loss_is_recognised():
    err = peer_loss(RuntimeError("[ring] connection to a peer was lost"), 1)
    assert err is not None and err.exit_code == 69 and "rank 1" in err.message
    assert peer_loss(ValueError("x"), 0) is None


# ---- the shared request and stop strings

def test_requests_survive_the_byte_round_trip():
    r = GenRequest(id="x", tokens=[1, 2, 3], max_tokens=4, temperature=0.5, seed=9, stop=["\n\n", "é"])
    assert GenRequest.decode(r.encode()) == r
    with pytest.raises(IntegrityError):
        GenRequest.decode(b'{"id": "x", "evil": 1}')


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("X more") == ("ENX more", False)
    assert m.feed(" and EN") == (" and ", False)
    assert m.feed("D tail") == ("", True)
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    m = StopMatcher(["ab"])
    assert m.feed("xa") == ("x", False)
    assert m.flush() == "a"



class _CharDetok:
    """A detokenizer whose token t is the one character chr(t)."""

    last_segment = ""

    def add_token(self, t: int) -> None:
        self.last_segment = chr(t)

    def finalize(self) -> None:
        self.last_segment = ""


def _seq(stops: list[str]) -> Seq:
    return Seq(req=GenRequest(id="x", tokens=[1, 2], max_tokens=9), uid=0, detok=_CharDetok(),
               stops=StopMatcher(stops))


def test_a_sampled_token_ends_a_request_by_eos_a_stop_string_or_the_schedules_word():
    """Seq.feed, the one token rule of both schedules (batch.py, overlap.py)."""
    s = _seq(["cd"])
    assert s.feed(ord("a"), eos=False, otherwise=None) is None
    assert s.feed(ord("c"), eos=False, otherwise=None) is None and s.parts == ["a"]  # "c" may start "cd": held
    assert s.feed(ord("d"), eos=False, otherwise="length") == "stop" and s.stopped_by_text
    r = s.result("stop")
    assert (r.text, r.tokens, r.finish_reason, r.prompt_tokens) == ("a", [97, 99, 100], "stop", 2)
    s = _seq([])
    assert s.feed(ord("a"), eos=False, otherwise="length") == "length"  # max_tokens: the schedule says so
    assert s.feed(0, eos=True, otherwise=None) == "stop" and s.tokens == [97]  # EOS is not part of the text
    assert s.so_far("error", "bad values") == GenResult(tokens=[97], text="a", finish_reason="error", prompt_tokens=2,
                                                         error="bad values")

def test_idle_schedule_slows_down_but_stays_responsive():
    assert idle_interval(0) == 0.02
    assert idle_interval(10_000) == 0.1
    assert all(idle_interval(i) <= idle_interval(i + 1) for i in range(1000))
    # ranks that call each other to meetings keep one slow schedule
    assert idle_interval(0, True) == idle_interval(10_000, True) == IDLE_WAKEABLE_S > 0.1


def test_an_idle_wait_ends_early_for_local_work_and_calls_the_others_to_that_meeting():
    calls = []
    idle = IdleWait(call=calls.append)
    threading.Timer(0.05, idle.local).start()
    t = time.monotonic()
    idle.wait(60, seq=7)
    assert time.monotonic() - t < 30  # not the scheduled 60 s
    assert calls == [7]  # the others are called to meeting 7
    idle.met(7)
    idle.wait(0.01, seq=8)  # a plain timeout: nobody is called
    assert calls == [7]


def test_a_call_is_sent_again_until_its_meeting_is_held():
    """A wake-up call is a datagram: until the meeting it called is held, it goes out again (a lost one would
    leave the caller spinning in the collective until the others' scheduled meeting, 10 s away)."""
    from clusterctl.rank.engine.schedule import CALL_AGAIN_S

    calls = []
    idle = IdleWait(call=calls.append)
    idle.local()
    idle.wait(60, seq=3)
    deadline = time.monotonic() + 30
    while len(calls) < 3:
        assert time.monotonic() < deadline, calls
        time.sleep(CALL_AGAIN_S / 2)
    assert set(calls) == {3}
    idle.met(3)
    time.sleep(2 * CALL_AGAIN_S)
    held = len(calls)
    time.sleep(3 * CALL_AGAIN_S)
    assert len(calls) == held  # the meeting was held: no more calls


def test_an_idle_wait_ends_early_for_a_call_to_the_coming_meeting_only():
    calls = []
    idle = IdleWait(call=calls.append)
    idle.called(3)  # a stale call: meeting 3 was held before this wait for meeting 5
    t = time.monotonic()
    idle.wait(0.3, seq=5)
    assert time.monotonic() - t >= 0.29
    threading.Timer(0.05, idle.called, args=(5,)).start()
    t = time.monotonic()
    idle.wait(60, seq=5)
    assert time.monotonic() - t < 30
    assert calls == []  # a rank that was called does not call the others again


def test_an_idle_wait_ends_early_when_its_check_says_there_is_work():
    calls, looks = [], []
    idle = IdleWait(call=calls.append, check=lambda: looks.append(1) or len(looks) >= 3)  # a cancel, 3rd look
    t = time.monotonic()
    idle.wait(60, seq=4)
    assert time.monotonic() - t < 30
    assert calls == [4] and len(looks) == 3  # the others are called to the meeting that applies it
    assert idle.sent == 1 and idle.heard == 0


def test_without_wake_up_calls_an_idle_wait_keeps_its_schedule():
    idle = IdleWait()
    idle.local()  # a request: the others come only at their scheduled time, so this rank waits too
    t = time.monotonic()
    idle.wait(0.2, seq=1)
    assert time.monotonic() - t >= 0.19


def test_a_queued_request_wakes_the_step_loops_idle_wait():
    woken = []
    q = RequestQueue(4)
    q.on_put = lambda: woken.append(True)
    assert q.put(ApiRequest(id="x", kind="completion", prepare=lambda tok: None, stream=False))
    assert woken == [True]


def test_checkpoints_come_about_every_tenth_of_a_second_at_any_speed():
    now = [0.0]
    c = Cadence(target=0.1, clock=lambda: now[0])
    now[0] += 0.5  # prefill plus the first 4 tokens: a slow start gives a short gap, corrected next time
    assert c.next_gap(4) == 1
    now[0] += 1 / 80  # one token at 80 tok/s
    assert c.next_gap(1) == 8
    now[0] += 8 / 80
    assert c.next_gap(8) == 8
    now[0] += 8 / 4  # the model slowed to 4 tok/s: check every token
    assert c.next_gap(8) == 1
    now[0] += 1e-6  # absurdly fast: capped
    assert c.next_gap(1) == MAX_CHECKPOINT
    assert c.next_gap(1) == MAX_CHECKPOINT  # no time passed at all


def test_a_rank_watches_its_keeper_and_a_detached_rank_no_parent(monkeypatch):
    def check():
        return Watchdog(rank=0, on_trip=lambda e: None, lease_path=None, lease_seconds=30).check()

    monkeypatch.setenv(KEEPER_PID_ENV, str(os.getppid()))
    assert check() is None  # started by its keeper, which still runs
    monkeypatch.setenv(KEEPER_PID_ENV, "1" if os.getppid() != 1 else "2")
    assert isinstance(check(), ParentGone)  # the keeper is gone (even before the watchdog started)
    monkeypatch.delenv(KEEPER_PID_ENV)
    assert check() is None  # detached: whoever spawned it may exit; nothing to watch


# ---- compute priority (rank/priority.py)

def test_compute_nice_comes_from_the_environment_within_0_to_19():
    from clusterctl.protocol.rankspec import DEFAULT_COMPUTE_NICE as DEFAULT_NICE, ENV_COMPUTE_NICE as ENV_NICE
    from clusterctl.protocol.rankspec import compute_nice_from_env as nice_from_env

    assert nice_from_env({}) == DEFAULT_NICE == 10
    assert nice_from_env({ENV_NICE: "0"}) == 0
    assert nice_from_env({ENV_NICE: "19"}) == 19
    for bad in ("20", "-1", "x", ""):
        assert nice_from_env({ENV_NICE: bad}) == DEFAULT_NICE
    assert parse_rank_spec(spec_dict(compute_nice=0)).compute_nice == 0
    with pytest.raises(Exception):
        parse_rank_spec(spec_dict(compute_nice=20))


_RENICE = """
import json, os, threading
import mlx.core as mx
from clusterctl.rank.priority import lower_compute
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))  # MLX starts its own threads
ev = threading.Event()
py = threading.Thread(target=ev.wait, daemon=True)  # never keeps the interpreter alive if a line below fails
py.start()
changed = lower_compute(7)
def nice(t):
    return os.getpriority(os.PRIO_PROCESS, t)
def alive_nices():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[t] = nice(int(t))
        except ProcessLookupError:  # a thread that ended after the listing (t2 below, MLX's short-lived ones)
            pass
    return out
late = []
t2 = threading.Thread(target=lambda: late.append(nice(threading.get_native_id())))
t2.start(); t2.join()  # started by the reniced main thread: inherits
try:
    print(json.dumps({"main": nice(threading.get_native_id()), "py": nice(py.native_id), "changed": changed,
                      "all": alive_nices(), "late": late}))
finally:
    ev.set()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are a Linux feature")
def test_lower_compute_renices_the_main_and_native_threads_not_python_threads():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _RENICE], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["main"] == 7 and doc["py"] == 0
    native = [int(t) for t, n in doc["all"].items() if n == 7]
    assert len(native) >= 2 and set(doc["changed"]) <= set(native)  # the main thread and at least one of MLX's
    assert sorted(set(doc["all"].values())) == [0, 7]
    assert doc["late"] == [7]


def test_prompt_groups_keep_padding_small_and_are_the_same_for_the_same_lengths():
    """Joining prompts are processed in groups padded to their longest: prompts the prompt cache covers whole
    (nothing left) go together, and one long prompt does not make three short ones pay its length."""
    from clusterctl.rank.engine.scheduler import PAD_WASTE, prompt_groups

    assert prompt_groups([]) == []
    assert prompt_groups([0, 0, 22, 0]) == [[0, 1, 3], [2]]
    assert prompt_groups([22, 25, 30, 1]) == [[3], [0, 1, 2]]
    import random

    rnd = random.Random(3)
    for _ in range(200):
        lengths = [rnd.choice([0, 1, rnd.randint(2, 300)]) for _ in range(rnd.randint(1, 9))]
        groups = prompt_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= PAD_WASTE * sum(lengths[i] for i in g) or len(g) == 1
        assert groups == prompt_groups(list(lengths))
