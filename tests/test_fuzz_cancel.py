"""Stateful fuzzing of cancel epochs: sequences of `clusterctl cancel` commands, rank 0 polling its cancel file,
meetings, and files going bad in between — checked against one invariant:

    whenever the coordinator says "all acked" for a cancel, rank 0 really applied THAT command's cancel file
    (and every other rank received its epoch in a meeting after that).

The pieces are the product's own, without SSH: the coordinator is ``clusterctl.launch.cancel.cancel_job`` on a
real (unsigned, not saved) launch manifest whose nodes are local (``LocalTransport``: real files in temp runtime
dirs); rank 0 is a real ``StepLoop`` (rank/engine/steploop.py) with a real ``CancelWatch`` and the ack writer the rank
runtime gives it (``write_ack``), driven one step at a time: ``apply_cancels`` is what rank 0 does at a meeting
before anything else (its scheduler, rank/engine/scheduler.py, polls the cancel watch first), ``ack(epoch)`` is what every
rank does with the epoch a meeting hands round: "one meeting of rank 0's cancel handling" without a model, a ring
or a thread.

Determinism: no timing decides anything. The coordinator's wait runs on a fake clock (its ``time`` is replaced, and
its poll interval is 0), and a responsive rank 0 takes exactly one step and one meeting before each read of an
ack. Two concurrent commands are interleaved in a fixed order: both read before either writes, then the writes
in the order drawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import shutil
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from fuzzutil import counting_fixtures, count, fuzz_settings

from clusterctl.errors import ClusterctlError

pytestmark = pytest.mark.slow  # a stateful fuzzer of cancel epochs (20 s)

DEP, JOB = "dep-1", "job-1"
WAIT = 1.0  # seconds of the fake clock a waiting cancel polls for (20 polls)
TICK = 0.05
FAST_ROOT = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # every write here fsyncs: tmpfs


_count_cases, _report_cases = counting_fixtures("cancel machine steps")


_who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="?")


class Coordinators:
    """Wraps the node handles `cancel_job` opens (``clusterctl.launch.cancel.handles``): records what each command
    wrote as its cancel file, lets a responsive rank 0 take a step before each ack read, and holds concurrent
    commands' writes until all of them have read, then lets them write in a given order."""

    def __init__(self, machine: "CancelMachine"):
        self.machine = machine
        self.written: dict[str, list[bytes]] = {}
        self.responsive: dict[str, bool] = {}
        self.order: list[str] = []  # concurrent writers, in write order; empty: no gate
        self.arrived: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.places = 1
        self.cond: asyncio.Condition | None = None

    def wrap(self, real_handles):
        def handles(nodes, ssh, **kw):
            hs = real_handles(nodes, ssh, **kw)
            for h in hs.values():
                self._wrap_one(h)
            return hs
        return handles

    def _wrap_one(self, h) -> None:
        read_json, write_file = h.read_json, h.write_file

        async def gated_read_json(path, **kw):
            who = _who.get()
            if path.endswith("-ack.json") and self.written.get(who) and self.responsive.get(who):
                self.machine.rank_step(meeting=True)
            return await read_json(path, **kw)

        async def gated_write_file(path, data, **kw):
            who = _who.get()
            is_cancel = path.endswith("-cancel.json")
            if is_cancel and self.order:
                async with self.cond:
                    self.arrived[who] = self.arrived.get(who, 0) + 1
                    self.cond.notify_all()
                    mine = self.order.index(who)
                    await self.cond.wait_for(lambda: sum(self.arrived.values()) >= self.places * len(self.order)
                                             and all(self.done.get(w, 0) >= self.places for w in self.order[:mine]))
            try:
                return await write_file(path, data, **kw)
            finally:
                if is_cancel:
                    self.written.setdefault(who, []).append(bytes(data))
                    if self.order:
                        async with self.cond:
                            self.done[who] = self.done.get(who, 0) + 1
                            self.cond.notify_all()

        h.read_json, h.write_file = gated_read_json, gated_write_file


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self) -> float:
        self.t += TICK
        return self.t


class CancelMachine(RuleBasedStateMachine):
    """One job (world 1 or 2, one node or two), its runtime dirs, its ranks' step loops and the files between
    them. ``applied`` is what rank 0 really took (as its CancelWatch returned it), ``acked_by`` the epochs each
    other rank received in meetings, each with the step it happened at."""

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="cancel-fuzz-", dir=FAST_ROOT))
        self.step = 0
        self.applied: list[tuple[int, dict]] = []
        self.acked_by: dict[int, list[tuple[int, int]]] = {}
        self.history: dict[int, list[bytes]] = {}  # rank -> every ack file content seen (for replays)
        self.cancel_history: list[bytes] = []
        self.commands = 0
        self.wclock = [0.0]
        self.logs: list[str] = []

    # ---- setup

    @initialize(world=st.sampled_from([1, 2]), two_nodes=st.booleans())
    def setup(self, world, two_nodes):
        from clusterctl.rank.cancelfile import CancelWatch, write_ack
        from clusterctl.statedir.manifest import LaunchManifest, RankRecord, this_coordinator
        from clusterctl.rank.engine.steploop import StepLoop
        from clusterctl.protocol.rankspec import RankSpec
        from clusterctl.protocol.nodespec import Node

        names = ["a", "b"] if world == 2 and two_nodes else ["a"]
        self.world = world
        self.rds = {n: self.root / f"run-{n}" for n in names}
        for d in self.rds.values():
            d.mkdir(mode=0o700)
        node_of = {r: names[r % len(names)] for r in range(world)}
        self.rank_rd = {r: self.rds[node_of[r]] for r in range(world)}
        nodes = [Node(name=n, local=True, runtime_dir=str(self.rds[n])) for n in names]
        ranks = [RankRecord(rank=r, node=node_of[r], host="localhost", local=True,
                            runtime_dir=str(self.rank_rd[r]), marker_path=str(self.rank_rd[r] / f"{JOB}-rank{r}.json"),
                            contract_path=str(self.rank_rd[r] / f"{JOB}-rank{r}.contract")) for r in range(world)]
        self.manifest = LaunchManifest(job_id=JOB, deployment_id=DEP, plan_hash="0" * 64, deployment_file="/d.json",
                                       created_at="t", nonce="n", coordinator=this_coordinator(), nodes=nodes,
                                       ranks=ranks)
        counts = [1] * world
        self.loops = {}
        for r in range(world):
            start = sum(counts[r + 1:])
            spec = RankSpec(deployment_id=DEP, job_id=JOB, nonce="n", node=node_of[r], rank=r, world_size=world,
                            model_path="/m", start_layer=start, end_layer=start + 1, layer_counts=counts,
                            num_layers=world, hostfile=str(self.rank_rd[r] / "h") if world > 1 else None,
                            http_port=8000 if r == 0 else None, runtime_dir=str(self.rank_rd[r]),
                            marker_path=str(self.rank_rd[r] / f"{JOB}-rank{r}.json"),
                            gate_path=str(self.rank_rd[r] / "g"), peer_probes=False)
            watch = CancelWatch(str(self.rank_rd[0]), DEP, JOB, log=self.logs.append,
                                clock=lambda: self.wclock[0]) if r == 0 else None
            if watch is not None:
                real_poll = watch.poll

                def poll(real_poll=real_poll):
                    doc = real_poll()
                    if doc is not None:
                        self.applied.append((self.step, doc.model_dump(mode="json")))
                    return doc
                watch.poll = poll

            def on_ack(epoch, applied, r=r, **kw):  # what the rank runtime hands its step loop (runtime.py)
                write_ack(str(self.rank_rd[r]), DEP, JOB, r, epoch, applied, **kw)
                self.acked_by.setdefault(r, []).append((self.step, epoch))

            self.loops[r] = StepLoop(spec, None, None, None, stop=threading.Event(), cancels=watch, on_ack=on_ack)

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- the ranks

    def rank_step(self, *, meeting: bool) -> None:
        """Rank 0 at a meeting: look at the cancel file (the watch's clock moved on), apply a new epoch (a world of
        one acks at once); with ``meeting``, the epoch goes round and every rank acks it."""
        self.step += 1
        self.wclock[0] += 1.0
        loop0 = self.loops[0]
        loop0.apply_cancels()
        if meeting and self.world > 1:
            for loop in self.loops.values():
                loop.ack(loop0.epoch)
        count("rank steps")
        from clusterctl.protocol.runtimefiles import ack_path

        for r in range(self.world):  # every ack a rank wrote: what a later "replay" may restore
            with contextlib.suppress(OSError):
                data = ack_path(self.rank_rd[r], DEP, r).read_bytes()
                if not self.history.get(r) or self.history[r][-1] != data:
                    self.history.setdefault(r, []).append(data)

    @rule()
    def rank0_looks(self):
        self.rank_step(meeting=False)

    @rule()
    def meeting(self):
        self.rank_step(meeting=True)

    # ---- the coordinator

    def _run(self, plans: list[tuple[str, list[str] | None, bool, bool]], order: list[str]) -> list:
        """Run `cancel_job` once per plan (name, requests, wait, rank 0 responsive) in one event loop; with
        ``order``, concurrently with the writes in that order."""
        import clusterctl.launch.cancel as cancel_mod
        from clusterctl.connect.nodes import Connector

        co = Coordinators(self)
        co.order, co.places = order, len(self.rds)
        for name, _, _, responsive in plans:
            co.responsive[name] = responsive
        clock = FakeClock()

        async def one(name, requests, wait):
            _who.set(name)
            try:
                return await cancel_mod.cancel_job(self.manifest, Connector(), requests, wait=WAIT if wait else 0)
            except ClusterctlError as e:
                assert e.message and "\n" not in e.message, e.message
                return e
            finally:  # a command that ended without writing must not hold the other at the gate
                async with co.cond:
                    co.arrived[name] = max(co.arrived.get(name, 0), co.places)
                    co.done[name] = max(co.done.get(name, 0), co.places)
                    co.cond.notify_all()

        async def all_of():
            co.cond = asyncio.Condition()
            return await asyncio.gather(*(one(n, rq, w) for n, rq, w, _ in plans))

        mp = pytest.MonkeyPatch()
        try:
            mp.setattr(cancel_mod, "handles", co.wrap(cancel_mod.handles))
            mp.setattr(cancel_mod, "ACK_POLL", 0)
            if hasattr(cancel_mod, "time"):
                mp.setattr(cancel_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic, time=time.time))
            results = asyncio.run(all_of())
        finally:
            mp.undo()
        for (name, *_), res in zip(plans, results):
            self._check(name, res, co.written.get(name, []))
        return results

    def _check(self, name: str, res, written: list[bytes]) -> None:
        """The invariant, for one command that returned."""
        if isinstance(res, ClusterctlError):
            count("refused cleanly")
            return
        self.commands += 1
        for data in written:
            self.cancel_history.append(data)
        if not res["waited"]:
            count("written")
            return
        if not res["all_acked"]:
            count("not acked (exit 1)")
            return
        count("acked")
        assert written, f"{name}: acked, but it wrote no cancel file"
        mine = json.loads(written[0])
        took = [(s, d) for s, d in self.applied if d == mine]
        assert took, (f"{name}: the coordinator says every rank acked epoch {res['epoch']}, but rank 0 never applied "
                      f"this command's cancel file {mine}; rank 0 applied "
                      f"{[(d['epoch'], d.get('nonce')) for _, d in self.applied]}; acks {res['acks']}")
        at = took[0][0]
        for r in range(1, self.world):
            later = [e for s, e in self.acked_by.get(r, []) if s >= at and e >= mine["epoch"]]
            assert later, (f"{name}: rank {r}'s ack was counted for epoch {mine['epoch']}, but no meeting after rank 0 "
                           f"applied it gave rank {r} that epoch (its acks: {self.acked_by.get(r)})")

    @rule(wait=st.sampled_from([True, True, False]), responsive=st.booleans(), named=st.booleans())
    def cancel(self, wait, responsive, named):
        """`clusterctl cancel JOB (--all | --request ID) [--wait S]`, rank 0 answering during the wait or not."""
        requests = [f"cmpl-{self.commands}"] if named else None
        self._run([("A", requests, wait, responsive)], [])

    @rule(first=st.sampled_from(["A", "B"]), responsive=st.booleans())
    def two_cancels_at_once(self, first, responsive):
        """Two `clusterctl cancel --wait` at the same time: both read the files before either writes."""
        order = [first, "B" if first == "A" else "A"]
        self._run([("A", None, True, responsive), ("B", [f"cmpl-{self.commands}"], True, responsive)], order)

    # ---- files going bad

    def _put(self, path: Path, data: bytes) -> None:
        with contextlib.suppress(IsADirectoryError, OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
        tmp = path.with_name(f".{path.name}.fuzz.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _doc(self, **kw) -> bytes:
        doc = {"schema_version": 1, "type": "cancel", "deployment_id": DEP, "job_id": JOB, "epoch": 1,
               "requests": None, "created_at": time.time()}
        doc.update(kw)
        return json.dumps(doc).encode()

    CANCEL_DAMAGE = ["garbage", "truncated", "empty", "oversized", "garbled epoch", "epoch max", "other job",
                     "other user", "folder", "symlink", "removed", "replay", "operator epoch"]

    @rule(data=st.data())
    def damage(self, data):
        """A file goes bad between commands: a node's cancel file or a rank's ack."""
        if data.draw(st.booleans(), label="the cancel file (else an ack)"):
            self.damage_cancel_file(data.draw(st.sampled_from(["a", "b"]), label="node"),
                                    data.draw(st.sampled_from(self.CANCEL_DAMAGE), label="damage"),
                                    data.draw(st.integers(1, 40), label="epoch"))
        else:
            self.damage_ack(data.draw(st.integers(0, 1), label="rank"),
                            data.draw(st.sampled_from(self.ACK_DAMAGE), label="damage"),
                            data.draw(st.integers(0, 100), label="pick"))

    def damage_cancel_file(self, node, kind, epoch):
        """What may happen to a node's cancel file between commands: corruption, a file nobody can read (over
        64 KiB, another user's), another job's, an old one restored, or a valid one an operator wrote by hand."""
        from clusterctl.protocol.runtimefiles import EPOCH_MAX, cancel_path

        rd = self.rds.get(node) or self.rds["a"]
        path = cancel_path(rd, DEP)
        if kind == "garbage":
            self._put(path, b"\x00\xffnot json{")
        elif kind == "truncated":
            self._put(path, self._doc(epoch=epoch)[:25])
        elif kind == "empty":
            self._put(path, b"")
        elif kind == "oversized":
            self._put(path, self._doc(epoch=epoch + 50, requests=["r" * (70 << 10)]))
        elif kind == "garbled epoch":
            self._put(path, self._doc(epoch=2**40 + epoch))
        elif kind == "epoch max":
            self._put(path, self._doc(epoch=EPOCH_MAX))
        elif kind == "other job":
            self._put(path, self._doc(epoch=epoch + 100, job_id="job-0"))
        elif kind == "other user":
            if os.geteuid() != 0:
                return
            self._put(path, self._doc(epoch=epoch + 20))
            os.chown(path, 54321, 54321)
        elif kind == "folder":
            with contextlib.suppress(OSError):
                path.unlink()
            path.mkdir(exist_ok=True)
        elif kind == "symlink":
            target = self.root / f"elsewhere-{node}.json"
            target.write_bytes(self._doc(epoch=epoch + 10))
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            path.symlink_to(target)
        elif kind == "removed":
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        elif kind == "replay":
            if self.cancel_history:
                self._put(path, self.cancel_history[epoch % len(self.cancel_history)])
        elif kind == "operator epoch":  # a valid cancel of this job, written by hand: rank 0 may apply it
            self._put(path, self._doc(epoch=epoch))
        count(f"cancel file {kind}")

    ACK_DAMAGE = ["garbage", "truncated", "oversized", "removed", "replay", "other job"]

    def damage_ack(self, rank, kind, pick):
        """What may happen to a rank's ack file: corruption, removal, another job's, or an older copy restored
        (only ever an ack some rank really wrote: a forged ack is outside what the epochs can detect)."""
        from clusterctl.protocol.runtimefiles import ack_path

        rank %= self.world
        path = ack_path(self.rank_rd[rank], DEP, rank)
        try:
            current = path.read_bytes()
            self.history.setdefault(rank, []).append(current)
        except OSError:
            current = b""
        if kind == "garbage":
            self._put(path, b"{{{")
        elif kind == "truncated":
            self._put(path, current[: len(current) // 2])
        elif kind == "oversized":
            self._put(path, b" " * (70 << 10) + current)
        elif kind == "removed":
            with contextlib.suppress(OSError):
                path.unlink()
        elif kind == "replay":
            old = self.history.get(rank) or []
            if old:
                self._put(path, old[pick % len(old)])
        elif kind == "other job" and current:
            with contextlib.suppress(ValueError):
                doc = json.loads(current)
                doc["job_id"] = "job-0"
                doc["epoch"] = doc.get("epoch", 0) + 1000 if isinstance(doc.get("epoch"), int) else 1000
                self._put(path, json.dumps(doc).encode())
        count(f"ack {kind}")

    @invariant()
    def rank0_epochs_only_grow(self):
        if not hasattr(self, "loops"):
            return
        epochs = [d["epoch"] for _, d in self.applied]
        assert epochs == sorted(set(epochs)), f"rank 0 applied epochs out of order or twice: {epochs}"


def test_cancel_epochs_stateful():
    run_state_machine_as_test(CancelMachine, settings=fuzz_settings(0.5, stateful_step_count=20))


def test_the_machine_reaches_every_outcome():
    """The machine is not vacuous: a plain sequence (cancel, rank 0 answers) is acked, and a cancel that rank 0
    cannot see is not."""
    m = CancelMachine()
    try:
        m.setup(world=2, two_nodes=True)
        res = m._run([("A", None, True, True)], [])[0]
        assert res["all_acked"] is True and m.applied, res
        m.damage_cancel_file(node="a", kind="folder", epoch=1)
        res = m._run([("A", None, True, True)], [])[0]
        assert isinstance(res, ClusterctlError) or res["all_acked"] is False, res
    finally:
        m.teardown()
