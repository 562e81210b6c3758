"""The step loop's decisions (rank/engine/scheduler.py), without MLX: joins and their fairness, a burst spread over the
micro-batches, cancels at every point of a request's life, the cancel epochs' one rule, and the batch changes'
encoder and decoder. Every test runs in milliseconds."""

from __future__ import annotations

import json
import sys

import pytest

from clusterctl.errors import ClusterctlError, IntegrityError
from clusterctl.rank.engine import scheduler as sch
from clusterctl.rank.engine.requestqueue import ApiRequest, RequestQueue
from clusterctl.rank.engine.generation import GenRequest
from clusterctl.rank.engine.scheduler import BatchChanges, Epochs, OverlapRun, RunEnd, Scheduler, join_count, place
from clusterctl.rank.cancelfile import CancelWatch
from clusterctl.protocol.runtimefiles import (EPOCH_MAX, CancelFile, EpochsUsedUp, cancel_here, cancel_path,
                                           epoch_is_new, next_epoch)


def api_request(rid: str, n: int = 3) -> ApiRequest:
    return ApiRequest(id=rid, kind="completion", prepare=lambda _: None, stream=False,
               req=GenRequest(id=rid, tokens=list(range(1, n + 1)), max_tokens=4))


def queue(*ids: str) -> tuple[RequestQueue, dict[str, ApiRequest]]:
    q, reqs = RequestQueue(), {}
    for rid in ids:
        reqs[rid] = api_request(rid)
        q.put(reqs[rid])
    return q, reqs


def answered(j: ApiRequest) -> list:
    out = []
    while not j.events.empty():
        out.append(j.events.get_nowait())
    return out


class Cancels:
    """A cancel watch that hands out the cancels it is given, one per poll."""

    def __init__(self):
        self.docs: list[CancelFile] = []

    def send(self, epoch: int, requests: list[str] | None, nonce: str = "ab" * 8) -> None:
        self.docs.append(CancelFile(deployment_id="d", job_id="j", epoch=epoch, requests=requests, created_at=0.0,
                                    nonce=nonce))

    def poll(self):
        return self.docs.pop(0) if self.docs else None


def test_the_scheduler_loads_no_mlx_nor_numpy():
    import subprocess  # a fresh interpreter: this one may have loaded MLX for other tests

    code = ("import sys, clusterctl.rank.engine.scheduler; "
            "print(sorted(m for m in ('mlx', 'numpy', 'mlx_lm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- joins

def test_joins_come_in_queue_order_and_a_full_batch_leaves_the_rest_queued():
    q, reqs = queue("a", "b", "c", "d", "e")
    s = Scheduler(q)
    ch = s.meeting(room=3)
    assert [r.id for r in ch.adds] == ["a", "b", "c"] and not ch.drops and not ch.finishes
    assert len(q) == 2 and set(s.joining) == {"a", "b", "c"} and not s.inflight
    for r in ch.adds:
        assert s.joined(r.id) is reqs[r.id] and reqs[r.id].started_at is not None
    assert list(s.inflight) == ["a", "b", "c"] and not s.joining
    # a slot freed: the next in line, not a later one
    assert s.left("b") is reqs["b"]
    assert [r.id for r in s.meeting(room=1).adds] == ["d"]


def test_a_request_cancelled_while_queued_takes_no_slot_and_is_answered():
    q, reqs = queue("a", "b", "c")
    reqs["a"].cancelled.set()
    s = Scheduler(q)
    assert [r.id for r in s.meeting(room=2).adds] == ["b", "c"]
    assert answered(reqs["a"])[0].result.finish_reason == "cancelled"
    assert "a" not in s.joining and "a" not in s.inflight


def test_a_join_carries_the_prompt_cache_decision():
    q, _ = queue("a", "b")
    s = Scheduler(q, lookup=lambda req: (7, 2) if req.id == "b" else None)
    a, b = s.meeting(room=2).adds
    assert (a.cache_from, a.cache_len) == (None, 0) and (b.cache_from, b.cache_len) == (7, 2)


def test_no_queue_no_room_no_joins():
    assert not Scheduler(None).meeting(room=4)
    q, _ = queue("a")
    assert not Scheduler(q).meeting(room=0) and len(q) == 1


@pytest.mark.parametrize("sizes, waiting, room, want", [
    ([0, 0], 8, 8, [4, 4]),  # a burst into an empty batch: half each
    ([0, 0], 5, 8, [3, 2]),
    ([0, 0, 0], 7, 16, [3, 2, 2]),
    ([3, 0], 3, 8, [0, 3]),  # the emptier micro-batch takes the burst
    ([2, 2], 9, 4, [2, 2]),  # the batch's room bounds it
    ([1, 1], 0, 8, [0, 0]),  # nothing waits
])
def test_a_burst_of_joins_is_spread_over_the_micro_batches(sizes, waiting, room, want):
    got = []
    sizes = list(sizes)
    for k in range(len(sizes)):  # each micro-batch decided in turn, as an overlapped run does
        n = join_count(sizes, k, room, waiting)
        got.append(n)
        sizes[k] += n
        room -= n
        waiting -= n
    assert got == want


@pytest.mark.parametrize("lengths, n, want", [
    ([0, 0], 4, [0, 1, 0, 1]),  # joins at a meeting alternate over empty micro-batches
    ([3, 0, 1], 4, [1, 1, 2, 1]),  # the emptiest first, counting the ones just placed; the lowest index on a tie
    ([2, 2], 0, []),
    ([5], 3, [0, 0, 0]),  # one stage: one micro-batch
])
def test_joins_at_a_meeting_go_to_the_micro_batches_with_the_fewest_rows(lengths, n, want):
    got = place(lengths, n)
    assert got == want
    after = list(lengths)
    for k in got:
        after[k] += 1
    assert max(after) - min(after) <= max(max(lengths) - min(lengths), 1)  # never less even than before


def run_for(q: RequestQueue, *, n: int = 2, max_batch: int = 8, cancels=None) -> tuple[Scheduler, OverlapRun]:
    s = Scheduler(q, cancels=cancels)
    return s, OverlapRun(s, n, max_batch, clock=iter(range(10**6)).__next__)


def test_an_overlapped_run_spreads_a_burst_and_a_join_revives_a_parked_micro_batch_without_ending_the_run():
    q, _ = queue(*"abcdef")
    s, run = run_for(q)
    ch0, end0, rev0 = run.decide(0, [0, 1], [], fresh=False, mb_sizes=[0, 0], held=0, stop=False)
    ch1, end1, rev1 = run.decide(1, [0, 1], [], fresh=False, mb_sizes=[0, 0], held=0, stop=False)
    assert [r.id for r in ch0.adds] == ["a", "b", "c"] and [r.id for r in ch1.adds] == ["d", "e", "f"]
    assert not end0 and not end1 and rev0 is None and rev1 is None and {k for k, _ in s.joining.values()} == {0, 1}
    for rid in "abcdef":
        s.joined(rid)
    # micro-batch 1 sat the run out and a request arrives: it joins micro-batch 1 through micro-batch 0's control,
    # which revives it; the run goes on (no meeting, no drained pipeline)
    q.put(api_request("g"))
    ch, end, revive = run.decide(0, [0], [("a", False)], fresh=False, mb_sizes=[1, 0], held=1, stop=False)
    assert [r.id for r in ch.adds] == ["g"] and revive == 1 and not end and not run.ending and run.why is None
    assert s.joining["g"][0] == 1 and not len(q)
    # until every rank has applied that control, micro-batch 1 is revived already: another arrival does not
    # revive it twice, it waits for its share (micro-batch 0 holds one row, micro-batch 1 one joining)
    q.put(api_request("h"))
    ch, end, revive = run.decide(0, [0], [("a", False)], fresh=False, mb_sizes=[1, 0], held=1, stop=False)
    assert [r.id for r in ch.adds] == ["h"] and revive is None and not end
    # the one live micro-batch's last row is answered as a request arrives whose share is the parked one's: that
    # one comes back and the other parks, in the same control; the run goes on
    q, _ = queue("x")
    s, run = run_for(q)
    ch, end, revive = run.decide(1, [1], [("g", True)], fresh=False, mb_sizes=[0, 0], held=1, stop=False)
    assert ch.finishes == ("g",) and [r.id for r in ch.adds] == ["x"] and revive == 0 and end and not run.ending


def test_an_overlapped_micro_batch_with_nothing_left_parks_and_an_empty_batch_ends_the_run():
    _, run = run_for(None)
    ch, end, _ = run.decide(0, [0, 1], [("a", True)], fresh=False, mb_sizes=[0, 1], held=2, stop=False)
    assert ch.finishes == ("a",) and end and not run.ending  # parked: the other micro-batch goes on
    ch, end, _ = run.decide(1, [1], [("b", True)], fresh=False, mb_sizes=[0, 0], held=1, stop=False)
    assert ch.finishes == ("b",) and end and run.why is RunEnd.EMPTY  # nothing left anywhere: meet


def test_a_stop_ends_every_micro_batch_and_takes_no_joins():
    q, _ = queue("a")
    _, run = run_for(q)
    ch, end, revive = run.decide(0, [0], [("x", False)], fresh=False, mb_sizes=[1, 0], held=1, stop=True)
    assert end and not ch and revive is None and len(q) == 1 and run.why is RunEnd.STOP


# ---- cancels at every point of a request's life

def test_cancels_at_every_point_queued_joining_in_the_batch_and_finishing():
    cancels, acks = Cancels(), []
    q, reqs = queue("queued")
    s = Scheduler(q, cancels=cancels, on_ack=lambda e, applied, **kw: acks.append((e, sorted(applied), kw)))
    # in the batch, decided to join (overlapped, not applied yet), finishing (answered, its row not yet gone)
    for rid in ("mid", "joining"):
        q.put(reqs.setdefault(rid, api_request(rid)))
    q.remove(reqs["queued"])
    q.put(reqs["queued"])  # the queue: mid, joining, queued
    assert [r.id for r in s.take(1)] == ["mid"]
    s.joined("mid")
    assert [r.id for r in s.take(1, into=1)] == ["joining"]
    fin = api_request("fin")
    s.joining["fin"] = (0, fin)
    s.joined("fin")
    assert s.left("fin") is fin  # answered: rank 0 let it go when it finished
    cancels.send(1, ["queued", "joining", "mid", "fin"])
    run = OverlapRun(s, 2, 8, clock=iter(range(10**6)).__next__)
    ch, _, _ = run.decide(0, [0, 1], [("mid", False), ("fin", True)], fresh=False, mb_sizes=[1, 0], held=2,
                       stop=False)
    assert ch.drops == ("mid",) and ch.finishes == ("fin",) and not ch.adds  # "queued" was answered instead
    assert answered(reqs["queued"])[0].result.finish_reason == "cancelled"
    assert reqs["joining"].cancelled.is_set() and not fin.cancelled.is_set()
    # the epoch travels only once every live micro-batch's drops are decided
    assert run.epoch_out == 0
    s.joined("joining")  # applied at micro-batch 1's next slot: then dropped at its next decision
    ch, _, _ = run.decide(1, [0, 1], [("joining", False)], fresh=False, mb_sizes=[0, 1], held=2, stop=False)
    assert ch.drops == ("joining",) and run.epoch_out == 1
    s.epochs.ack(run.epoch_out)
    assert acks == [(1, ["joining", "mid", "queued"], {"nonce": "ab" * 8, "recent": [(1, "ab" * 8)]})]


def test_a_meeting_drops_the_cancelled_and_refills_their_slots():
    cancels = Cancels()
    q, reqs = queue("a", "b", "c")
    s = Scheduler(q, cancels=cancels)
    for r in s.meeting(room=2).adds:
        s.joined(r.id)
    cancels.send(1, None)  # all: those in the batch and those queued
    ch = s.meeting(room=0)
    assert ch.drops == ("a", "b") and not ch.adds
    assert answered(reqs["c"])[0].result.finish_reason == "cancelled"
    assert s.epochs.epoch == 1 and s.epochs.applied[1] == ["a", "b", "c"]


def test_a_meeting_lets_the_answered_go_and_a_cancelled_row_leaves_once():
    cancels = Cancels()
    q, _ = queue("a", "b")
    s = Scheduler(q, cancels=cancels)
    for r in s.meeting(room=2).adds:
        s.joined(r.id)
    cancels.send(3, ["a"])
    ch = s.meeting(room=0, ended=["a", "b"])  # both answered rows still in micro-batches; "a" is also cancelled
    assert ch.drops == ("a",) and ch.finishes == ("b",)


def test_ending_every_request_reaches_the_joining_ones_too():
    q, _ = queue("a", "b")
    s = Scheduler(q)
    s.meeting(room=2)
    s.joined("a")
    assert sorted(j.id for j in s.release_all()) == ["a", "b"] and not s.inflight and not s.joining


# ---- epochs: one rule on both sides

def test_epochs_never_wrap_and_writers_and_readers_agree():
    assert next_epoch(0) == 1 and next_epoch(EPOCH_MAX - 1) == EPOCH_MAX
    with pytest.raises(EpochsUsedUp):
        next_epoch(EPOCH_MAX)
    assert epoch_is_new(EPOCH_MAX, EPOCH_MAX - 1) and not epoch_is_new(1, EPOCH_MAX)
    assert not epoch_is_new(EPOCH_MAX + 1, 0) and not epoch_is_new(5, 5)
    # every epoch a writer makes is one the readers take, up to the last
    for top in (0, 1, 41, EPOCH_MAX - 2, EPOCH_MAX - 1):
        assert epoch_is_new(next_epoch(top), top)


def test_rank_0s_own_cancel_at_the_last_epoch_is_refused_not_wrapped(tmp_path):
    w = CancelWatch(str(tmp_path), "dep", "job-1", log=lambda m: None)
    w.consumed = EPOCH_MAX - 1
    assert cancel_here(str(tmp_path), "dep", "job-1", ["cmpl-a"], consumed=EPOCH_MAX - 1) == EPOCH_MAX
    assert w.poll().epoch == EPOCH_MAX
    before = cancel_path(tmp_path, "dep").read_bytes()
    with pytest.raises(ClusterctlError, match="used up"):  # the rank's abort stage logs it (runtime.py)
        cancel_here(str(tmp_path), "dep", "job-1", ["cmpl-a"], consumed=EPOCH_MAX)
    assert cancel_path(tmp_path, "dep").read_bytes() == before


def test_every_rank_acks_each_new_epoch_once_in_order():
    acks = []
    e = Epochs(on_ack=lambda epoch, applied, **kw: acks.append(epoch))
    for epoch in (0, 1, 1, 3, 2, EPOCH_MAX, EPOCH_MAX, 1):
        e.ack(epoch)
    assert acks == [1, 3, EPOCH_MAX] and e.acked == EPOCH_MAX


def test_rank_0_applies_an_epoch_once_and_its_ack_names_the_nonce():
    cancels, acks = Cancels(), []
    e = Epochs(cancels, on_ack=lambda epoch, applied, **kw: acks.append((epoch, applied, kw["nonce"])))
    cancels.send(2, None, nonce="cd" * 8)
    cancels.send(2, None)  # the same epoch again (a second node's copy): not news
    assert e.poll({}, None) and not e.poll({}, None)
    e.ack(2)
    assert acks == [(2, [], "cd" * 8)] and list(e.recent) == [(2, "cd" * 8)]


# ---- the batch changes on the wire

def test_changes_round_trip_and_no_changes_are_no_bytes():
    req = GenRequest(id="a", tokens=[5, 6], max_tokens=3, temperature=0.5, stop=["x"], logit_bias={"5": -1.0},
                     grammar={"lark": "start: /a/"}, cache_from=2, cache_len=1, partition="p")
    ch = BatchChanges(adds=(req, GenRequest(id="b", tokens=[1], max_tokens=1)), drops=("c",), finishes=("d",))
    assert BatchChanges.decode(ch.encode()) == ch
    assert BatchChanges.decode(BatchChanges(drops=("c",)).encode()) == BatchChanges(drops=("c",))
    assert BatchChanges().encode() == b"" and BatchChanges.decode(b"") == BatchChanges() and not BatchChanges()


def _doc(**kw) -> bytes:
    doc = {"add": [{"id": "a", "tokens": [1], "max_tokens": 2}], "drop": []}
    doc.update(kw)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize("data", [
    b"{", b"[]", b"null", b'"add"', b"\xff\xfe",
    _doc(drop=...), _doc(add=...), _doc(extra=[]), _doc(add={}), _doc(drop="a"), _doc(drop=[1]), _doc(fin=[None]),
    _doc(add=[1]), _doc(add=[{"id": "a", "tokens": [1]}]), _doc(add=[{"id": "a", "tokens": [1], "max_tokens": 2,
                                                                       "evil": 1}]),
    _doc(add=[{"id": 7, "tokens": [1], "max_tokens": 2}]), _doc(add=[{"id": "a", "tokens": ["1"], "max_tokens": 2}]),
    _doc(add=[{"id": "a", "tokens": [1], "max_tokens": "2"}]), _doc(drop=["a"]), _doc(drop=["b"], fin=["b"]),
    b'{"add": [], "drop": [], "drop": ["x"]}',
])
def test_malformed_changes_are_refused(data):
    with pytest.raises(IntegrityError):
        BatchChanges.decode(data)


def test_changes_over_the_payload_bound_are_refused_on_both_sides(monkeypatch):
    monkeypatch.setattr(sch, "MAX_PAYLOAD", 100)
    big = BatchChanges(drops=tuple(f"r{i}" for i in range(40)))
    with pytest.raises(IntegrityError, match="exceed"):
        big.encode()
    with pytest.raises(IntegrityError, match="exceed"):
        BatchChanges.decode(b" " * 101)


# ---- the step loop executes the decisions (a world of one, a fake batch: still no MLX)

class FakeBatch:
    overlapped = False

    def __init__(self, max_batch: int):
        self.max_batch, self.rows, self.produced = max_batch, {}, 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def room(self) -> int:
        return self.max_batch - len(self.rows)

    def ids(self) -> list[str]:
        return list(self.rows)

    def ended(self) -> list[str]:
        return []

    def add(self, req, emit=None, prefix=None, emit_lp=None, grammar=None) -> None:
        self.rows[req.id] = emit

    def drop(self, rid: str, finish: str, *, save: bool = False):
        from clusterctl.rank.engine.generation import GenResult

        return GenResult([], "", finish, 1) if self.rows.pop(rid, None) is not None else None


def test_the_step_loop_applies_a_meetings_changes_and_answers_the_dropped(tmp_path):
    import threading

    from clusterctl.rank.engine.steploop import StepLoop
    from clusterctl.protocol.rankspec import RankSpec

    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=1, layer_counts=[1], num_layers=1, http_port=8000,
                    runtime_dir=str(tmp_path), marker_path=str(tmp_path / "m.json"), gate_path=str(tmp_path / "g"),
                    max_batch=2)
    cancels, acks = Cancels(), []
    q, reqs = queue("a", "b", "c")
    loop = StepLoop(spec, None, None, None, stop=threading.Event(), queue=q, cancels=cancels,
                    on_ack=lambda epoch, applied, **kw: acks.append((epoch, applied)))
    loop.batch = FakeBatch(2)
    assert loop._meet(1) == (False, 1)
    assert loop.batch.ids() == ["a", "b"] and list(loop.inflight) == ["a", "b"] and loop.active.ids() == ["a", "b"]
    cancels.send(1, ["a"])
    loop._meet(1)  # "a" leaves cancelled, "c" takes its slot, the epoch is acked at once (a world of one)
    assert loop.batch.ids() == ["b", "c"] and answered(reqs["a"])[-1].result.finish_reason == "cancelled"
    assert acks == [(1, ["a"])] and loop.acked == 1
    loop.stop.set()
    assert loop._meet(1)[0] and not loop.batch.ids() and not loop.inflight
    assert all(answered(reqs[r])[-1].error.status == 503 for r in "bc")


# ---- lockstep grammars: announced, then joined once every rank compiled them (compiler.py)

def grammar_request(rid: str) -> ApiRequest:
    j = api_request(rid)
    j.req.grammar = {"response_format": {"type": "json_object"}}
    return j


def test_a_grammar_request_is_announced_keeps_its_slot_and_joins_once_every_rank_compiled_it():
    q = RequestQueue()
    g1, plain, g2 = grammar_request("g1"), api_request("p"), grammar_request("g2")
    for j in (g1, plain, g2):
        q.put(j)
    s = Scheduler(q)
    s.announcing = True
    ch = s.meeting(room=3)
    assert [r.id for r in ch.announces] == ["g1", "g2"] and [r.id for r in ch.adds] == ["p"]
    assert BatchChanges.decode(ch.encode()) == ch and s.announced == 2 and not s.joining.keys() - {"p"}
    s.joined("p")
    # the others report one compile still running: only the first announced is done everywhere
    q.put(api_request("late"))
    s.compiled(2 - 1)
    ch = s.meeting(room=2)  # g1 and g2 hold two of the three slots: g1 joins, "late" waits behind g2's slot
    assert [r.id for r in ch.adds] == ["g1"] and not ch.announces and len(q) == 1
    s.compiled(2)
    assert [r.id for r in s.meeting(room=1).adds] == ["g2"]


def test_an_announced_request_cancelled_before_it_joins_is_answered_and_dropped_on_every_rank():
    q = RequestQueue()
    g = grammar_request("g")
    q.put(g)
    s = Scheduler(q)
    s.announcing = True
    assert [r.id for r in s.meeting(room=2).announces] == ["g"]
    g.cancelled.set()
    ch = s.meeting(room=2)
    assert ch.drops == ("g",) and not ch.adds and not s.held
    assert answered(g)[0].result.finish_reason == "cancelled"
    s.compiled(1)
    assert not s.meeting(room=2)  # it never joins


def test_without_announcing_a_grammar_request_joins_at_once():
    q = RequestQueue()
    q.put(grammar_request("g"))
    ch = Scheduler(q).meeting(room=1)
    assert [r.id for r in ch.adds] == ["g"] and not ch.announces


# -- prompts in chunks


def test_with_no_row_decoding_a_slot_processes_every_prompt_whole():
    assert sch.prefill_plan([(1, 2000), (3, 40)], decoding=False) == [2000, 40]


def test_while_rows_decode_a_slot_processes_one_budget_of_prompt_tokens():
    budget = sch.DECODE_BUDGET
    assert sch.prefill_plan([(1, 2000)], decoding=True) == [budget]
    assert sch.prefill_plan([(4, 2000)], decoding=True) == [budget // 4]
    # what the first group leaves of the budget goes to the next, never more than a group has left
    assert sch.prefill_plan([(1, 10), (1, 2000)], decoding=True) == [10, budget - 10]
    plan = sch.prefill_plan([(2, 5), (4, 500), (1, 500)], decoding=True)
    assert plan[0] == 5 and sum(r * c for (r, _), c in zip([(2, 5), (4, 500), (1, 500)], plan)) <= budget


def test_a_group_wider_than_the_budget_still_progresses_one_column_a_slot():
    wide = sch.DECODE_BUDGET + 8
    assert sch.prefill_plan([(wide, 300), (1, 300)], decoding=True) == [1, 0]
    assert sch.prefill_plan([(1, 0), (wide, 300)], decoding=True) == [0, 1]  # a group with nothing left


def test_a_long_prompt_joining_decoding_rows_is_done_in_bounded_slots():
    """Slot after slot, a 2,000-token prompt is processed a budget at a time and ends; the tokens add up."""
    left, slots = 2000, 0
    while left:
        (take,) = sch.prefill_plan([(1, left)], decoding=True)
        assert 0 < take <= sch.DECODE_BUDGET
        left -= take
        slots += 1
    assert slots == -(-2000 // sch.DECODE_BUDGET)


def test_a_slot_spends_the_budget_its_control_carries_and_still_progresses_below_one_column():
    assert sch.prefill_plan([(1, 2000)], decoding=True, budget=3) == [3]
    assert sch.prefill_plan([(2, 2000), (1, 9)], decoding=True, budget=5) == [2, 1]
    assert sch.prefill_plan([(4, 2000)], decoding=True, budget=0) == [1]  # the floor: one column of the first group
    assert sch.prefill_plan([(1, 2000)], decoding=False, budget=1) == [2000]  # nothing decodes: the whole prompt


def test_the_slot_budget_is_the_prompt_work_that_fits_the_stall_in_decode_steps():
    from clusterctl.rank.engine.slotcosts import STALL_STEPS, SlotCosts

    c = SlotCosts()
    assert c.budget() == int(STALL_STEPS)  # nothing measured: a prompt token is taken to cost a decode step
    c.stepped(0.1)
    assert c.budget() == int(STALL_STEPS)  # (nor is it before a token is measured)
    for token_s, want in [(0.1, 2), (0.01, 20), (0.2, 1), (1e-5, sch.DECODE_BUDGET)]:
        c = SlotCosts(weight=1.0)
        c.stepped(0.1)
        c.prompted(10, 10 * token_s)
        assert c.budget() == want, token_s
    c.prompted(0, 1.0)  # nothing processed, or no time: no observation
    c.stepped(0.0)
    assert (c.step_s, c.token_s) == (0.1, 1e-5)


@pytest.mark.parametrize("fixed_s,per_token_s,want", [
    (0.0, 0.1, 2),        # this CPU: a prompt token costs a decode step (0.1 s): 2 tokens a slot
    (0.05, 0.002, 75),    # a chunk's fixed cost and cheap tokens (Apple silicon): from 2 up to the stall, capped
    (0.05, 0.005, 30),    # ... where 0.05 + 0.005 n = 2 steps
    (0.3, 0.001, 1),      # one column already costs more than the stall: one a slot
])
def test_the_budget_settles_where_a_chunk_takes_the_stall(fixed_s, per_token_s, want):
    """A chunk of n tokens takes fixed_s + per_token_s * n; slot after slot the budget follows what the last
    chunks cost, and settles where a chunk takes STALL_STEPS decode steps (within a token), or at a bound."""
    from clusterctl.rank.engine.slotcosts import SlotCosts

    c, seen = SlotCosts(cap=64), []
    c.stepped(0.1)
    for _ in range(60):
        n = c.budget()
        c.prompted(n, fixed_s + per_token_s * n)
        seen.append(n)
    assert abs(seen[-1] - min(want, 64)) <= 1, seen
    assert all(1 <= n <= 64 for n in seen)


def test_every_reason_a_run_ends_has_its_metric_label():
    from clusterctl.rank.metrics import RUN_ENDS

    assert {e.value for e in RunEnd} == set(RUN_ENDS)


@pytest.mark.parametrize("columns,stages,want", [
    (1999, 2, 256),   # a long prompt: the largest chunk fills the pipeline (8 chunks)
    (299, 2, 48),     # a few hundred tokens on 2 stages: 7 chunks of 48, not 2 of 256 (which leave a stage idle)
    (299, 3, 32),     # 3 stages: the floor
    (20, 2, 32),      # shorter than the floor: one chunk
    (600, 2, 80),
    (299, 1, 256),    # one stage (or tensor parallelism): nothing to fill
])
def test_a_short_prompt_is_cut_into_chunks_that_fill_the_pipeline(columns, stages, want):
    chunk = sch.prefill_chunk(columns, stages)
    assert chunk == want
    assert chunk % 16 == 0 and sch.MIN_PREFILL_CHUNK <= chunk <= sch.PREFILL_CHUNK
    if stages > 1 and want > sch.MIN_PREFILL_CHUNK:
        assert -(-columns // chunk) >= sch.CHUNKS_PER_STAGE * stages - 1  # enough chunks for every stage


def test_a_smaller_largest_chunk_wins_over_the_floor():
    """(tests/rank/test_prompt_logprobs.py runs chunks of 4 to score a prompt across many of them.)"""
    assert sch.prefill_chunk(300, 2, largest=4) == 4
