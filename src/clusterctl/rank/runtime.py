"""The rank entrypoint: ``python -m clusterctl.rank --contract FILE --node NAME``.

Order of events: read the contract (nothing secret on argv) -> fix the environment -> import mlx -> marker
"loading" -> load only this rank's layers -> marker "ready" -> wait (sleeping, outside any collective) for the
launcher's gate file -> join the ring and check every peer runs the same job -> marker "serving" (rank 0: HTTP)
-> step loop until the ranks agree to stop.

Exits: 0 after SIGTERM/SIGINT (or a stop agreed with the other ranks); 1 when forced (second signal, or the
10 s stop alarm); 65 bad contract; 69 lost contact (ring peer, launcher lease, parent process); 78 config;
70 internal error (the only case with a traceback). Every failure leaves state "failed" and a one-line error in
the marker and on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from clusterctl.errors import ClusterctlError, Exit, UsageError
from clusterctl.protocol.rankspec import RankSpec, load_unsigned_spec
from clusterctl.hardexit import exit_now
from clusterctl.rank.api.admission import limits_for, use_template
from clusterctl.rank.api.phase import Phase
from clusterctl.rank.api.service import Api
from clusterctl.rank.choices import shares_prompts
from clusterctl.rank.engine.group import attach_group
from clusterctl.rank.engine.requestqueue import ActiveSet, RequestQueue
from clusterctl.rank.peerprobe import Ladder, Prober, Responder, Waker, job_token, watched_peers
from clusterctl.rank.engine.loading import apply_environment, load_shard, rank_environment
from clusterctl.rank.priority import lower_compute
from clusterctl.rank.ringjoin import join_ring, ring_addresses
from clusterctl.rank.engine.schedule import IdleWait
from clusterctl.rank.engine.steploop import StepLoop
from clusterctl.rank.watchdog import LeaseExpired, PeerLost, Watchdog, end_reason, peer_loss
from clusterctl.rank.api.wire import ApiError
from clusterctl.rank.cancelfile import CancelWatch, cancel_here, write_ack
from clusterctl.rank.markers import IDLE_HEARTBEAT_S, MarkerWriter
from clusterctl.protocol.runtimefiles import EndReason
from clusterctl.protocol.contract import load_rank_contract  # provided by the launcher side

UNSIGNED_ENV = "CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS"
STOP_GRACE_S = 10.0
GATE_POLL_S = 0.05
_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _say(msg: str) -> None:
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


FAILED_TELL_S = 1.0  # how long a failing rank 0 gives its HTTP threads to tell their clients
FAILED_RETRY_AFTER_S = 5


def _exit_now(code: int) -> None:
    # os._exit: a ring group's sockets and threads must not be able to hang interpreter shutdown
    exit_now(code)


class Rank:
    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.stopping = threading.Event()
        self.marker = None
        self.api = None
        self.watchdog = None
        self.responder = None
        self.prober = None
        self.loop = None
        self._signals = 0
        self._fatal_lock = threading.Lock()

    # ---- exits
    def fatal(self, err: ClusterctlError, state: str = "failed") -> None:
        """Marker ``state`` (``failed``; ``lost`` from the peer-loss ladder) with the reason, then exit at once,
        even with the main thread stuck in a collective. (No mx.clear_cache() first: it waits for the allocator
        that a stuck collective holds. The exit releases the rank's memory.)"""
        with self._fatal_lock:
            if self.marker is not None:
                self.marker.update(state=state, error=err.message, reason=end_reason(err), final=True)
            _say(f"error: {err.message}")
            self._tell_clients(err)
            _exit_now(int(err.exit_code))

    def _tell_clients(self, err: ClusterctlError) -> None:
        """Rank 0's clients hear why their requests end (503, retry later: a supervisor may heal the deployment)
        instead of meeting a cut connection."""
        if self.api is None:
            return
        try:
            self.api.fail_everyone(ApiError(503, f"the deployment stopped serving: {err.message}",
                                            type="server_error", code="deployment_unavailable",
                                            retry_after=FAILED_RETRY_AFTER_S), wait_s=FAILED_TELL_S)
        except Exception:  # a courtesy on the way out: never let it keep the rank from ending
            pass

    def _forced(self, why: str) -> None:
        msg = f"rank {self.spec.rank}: forced exit ({why})"
        if self.marker is not None:
            self.marker.update(state="stopping", error=msg, final=True)
        _say(msg)
        _exit_now(int(Exit.FAILED))

    def _signal_thread(self) -> None:
        while True:
            sig = signal.sigwait(_SIGNALS)
            self._signals += 1
            if self._signals > 1:
                self._forced(f"second signal {signal.Signals(sig).name}")
            self.stopping.set()
            if self.loop is not None:
                self.loop.wake()  # an idle rank holds its next meeting now (the stop vote), calling the others
            if self.api is not None:
                self.api.state.to(Phase.STOPPING)  # new requests get 503 from now on
            if self.marker is not None:
                self.marker.update(state="stopping")
            _say(f"rank {self.spec.rank}: {signal.Signals(sig).name}: stopping")
            timer = threading.Timer(STOP_GRACE_S, self._forced, args=(f"not stopped within {STOP_GRACE_S:g} s",))
            timer.daemon = True
            timer.start()

    def _graceful(self) -> int:
        self.marker.update(state="stopping")
        if self.prober is not None:
            self.prober.stop()
        if self.api is not None:
            self.api.stop()
        try:
            import mlx.core as mx

            try:
                mx.set_wired_limit(0)  # give wired memory back (Metal); harmless elsewhere
            except (AttributeError, RuntimeError, ValueError):
                pass
            mx.clear_cache()
        except ImportError:
            pass
        self.marker.update(state="stopping", final=True)
        idle = self.loop.idle if self.loop is not None else None
        said = [f"{idle.sent} wake-up call(s) sent, {idle.heard} heard"] if idle is not None and idle.can_call else []
        if self.loop is not None and self.spec.world_size > 1:
            said.append(f"{self.loop.checkpoints} meeting(s) while busy")
        _say(f"rank {self.spec.rank}: stopped" + (f" ({'; '.join(said)})" if said else ""))
        return 0

    # ---- the life of a rank
    def run(self) -> int:
        spec = self.spec
        threading.Thread(target=self._signal_thread, name="signals", daemon=True).start()
        self.marker = MarkerWriter(spec.marker_path, deployment_id=spec.deployment_id, job_id=spec.job_id,
                                   nonce=spec.nonce, rank=spec.rank, node=spec.node, idle_interval=IDLE_HEARTBEAT_S)
        self.marker.marker.start_layer, self.marker.marker.end_layer = spec.start_layer, spec.end_layer
        self.marker.start()
        self.watchdog = Watchdog(rank=spec.rank, on_trip=self._tripped, lease_path=spec.lease_path,
                                 lease_seconds=spec.lease_seconds)
        self.watchdog.start()
        try:
            return self._serve()
        except ClusterctlError as e:
            self.fatal(self._name_the_lost(e))
        except RuntimeError as e:
            lost = peer_loss(e, spec.rank)
            if lost is not None:
                self.fatal(self._name_the_lost(lost))
            self._crash()
        except Exception:
            self._crash()
        return int(Exit.SOFTWARE)

    def _name_the_lost(self, err: ClusterctlError) -> ClusterctlError:
        """A broken ring does not say which peer went: ask the watched peers once (≤ 0.5 s) and name the silent
        ones, so the marker (and `clusterctl status`) says "peer rank 1 does not answer"."""

        if not isinstance(err, PeerLost) or self.prober is None or err.peers:
            return err
        try:
            silent = self.prober.silent()
        except Exception:  # naming is a courtesy: never let it hide the real error
            return err
        if not silent:
            return err
        who = ", ".join(f"peer rank {p}" for p in silent)
        return PeerLost(f"{err.message}; {who} {'does' if len(silent) == 1 else 'do'} not answer",
                        peers=tuple(silent))

    def _crash(self) -> None:
        traceback.print_exc()
        err = sys.exc_info()[1]
        self.marker.update(state="failed", final=True, reason=EndReason.INTERNAL,
                           error=f"rank {self.spec.rank}: internal error: {type(err).__name__}: {err}"[:500])
        self._tell_clients(ClusterctlError(f"rank {self.spec.rank}: internal error"))
        _exit_now(int(Exit.SOFTWARE))

    def _join(self):
        return join_ring(self.spec, self.watchdog, self.responder, self.stopping, _say)

    def _serve(self) -> int:
        spec = self.spec
        queue = RequestQueue(spec.max_batch + spec.max_queue) if spec.rank == 0 else None
        marker = self.marker
        active = ActiveSet(lambda ids: marker.update(active_requests=ids))  # one set: HTTP and step loop
        if spec.rank == 0:
            self.api = Api(spec, queue, model_name=spec.served_name or Path(spec.model_path).name, active=active)
            self.api.start()
            if self.stopping.is_set():
                self.api.state.to(Phase.STOPPING)
        t0 = time.monotonic()
        model, tokenizer, config = load_shard(spec)
        if self.api is not None:
            self.api.state.to(Phase.READY)  # (not after a stop: phase.py) before the marker says so: whoever reads "ready" there finds it here too
        self.marker.update(state="ready")
        _say(f"rank {spec.rank}: loaded layers [{spec.start_layer}, {spec.end_layer}) of {spec.num_layers} in "
             f"{time.monotonic() - t0:.1f} s; waiting for the gate")
        gate = Path(spec.gate_path)
        while not gate.exists():
            if self.stopping.wait(GATE_POLL_S):
                return self._graceful()
        if self.stopping.is_set():
            return self._graceful()
        self._start_responder()
        group = self._join()
        if self.stopping.is_set():
            return self._graceful()
        if spec.parallel == "tensor":
            attach_group(model, group)
        # The model, tokenizer and libraries live for good: move them out of the collector's sight, so an
        # old-generation collection while serving walks only what requests made. A full walk of the ~82k objects
        # a loaded rank holds takes 55 ms idle (2.5 ms after the freeze), held the GIL, and under load made rank
        # 0's /health answer in 150-240 ms (bench/faults.py, load row).
        import gc

        gc.collect()
        gc.freeze()
        lower_compute(spec.compute_nice)  # the control plane (HTTP, probes, markers) runs first when cores are busy
        if self.api is not None:
            use_template(tokenizer, spec.serving.chat_template)
            self.api.serving(limits_for(config, tokenizer, spec.context_tokens), tokenizer)
            self.marker.update(state="serving", endpoint=self.api.endpoint)
            _say(f"rank 0: serving at {self.api.endpoint}")
        else:
            self.marker.update(state="serving")
        cancels = CancelWatch(spec.runtime_dir, spec.deployment_id, spec.job_id, log=_say) \
            if spec.rank == 0 and spec.cancel_checks else None
        metrics = self.metrics

        def on_ack(epoch: int, applied: list[str], *, nonce: str | None = None, recent=()) -> None:
            try:
                write_ack(spec.runtime_dir, spec.deployment_id, spec.job_id, spec.rank, epoch, applied, nonce=nonce,
                          recent=recent)
            except ClusterctlError as e:
                _say(f"rank {spec.rank}: cannot write the cancel ack: {e.message}")
                if metrics is not None:
                    metrics.ack_failed()
            if metrics is not None:
                metrics.cancel_acked(epoch, len(applied))
            marker.update(cancel_epoch=epoch)
            _say(f"rank {spec.rank}: cancel epoch {epoch} applied" + (f" to {', '.join(applied)}" if applied else ""))

        # n choices share their prompt's KV (choices.py) on plain caches; a quantized cache (plan --kv-bits) is not
        # shared: each choice processes its prompt (the two landed together, and that pairing is untested)
        share = shares_prompts(config) and spec.kv_bits is None
        loop = StepLoop(spec, model, tokenizer, group, stop=self.stopping, queue=queue, marker=self.marker,
                        watchdog=self.watchdog, active=active, cancels=cancels, on_ack=on_ack,
                        idle=self._idle_wait(cancels), metrics=self.metrics, share_prompts=share)
        self.loop = loop
        self._start_prober(loop)
        loop.run()
        return self._graceful()

    @property
    def metrics(self):
        """Rank 0's metrics (rank/metrics.py, served at /metrics); None on the other ranks."""
        return self.api.metrics if self.api is not None else None

    # ---- the peer-loss ladder (rank/peerprobe.py)
    def _ring_addresses(self) -> list[tuple[str, int]] | None:
        return ring_addresses(self.spec)

    def _start_responder(self) -> None:
        addrs = self._ring_addresses()
        if addrs is None:
            return
        host, port = addrs[self.spec.rank]
        try:
            self.responder = Responder(host, port, job_token(self.spec.job_id, self.spec.nonce), self.spec.rank).start()
        except OSError as e:
            _say(f"rank {self.spec.rank}: peer probes off: cannot answer probes on udp {host}:{port} ({e.strerror or e})")

    def _idle_wait(self, cancels=None):
        """The step loop's idle wait, with wake-up calls to and from the other ranks when this rank answers on
        the peer-probe port (schedule.IdleWait); rank 0 also wakes for a changed cancel file (``cancels``)."""

        spec = self.spec
        addrs = self._ring_addresses()
        if addrs is None or self.responder is None:
            return IdleWait()
        waker = Waker({p: a for p, a in enumerate(addrs) if p != spec.rank}, job_token(spec.job_id, spec.nonce),
                      spec.rank)
        idle = IdleWait(call=waker.send, check=cancels.changed if cancels is not None else None)
        self.responder.on_wake = idle.called
        return idle

    def _start_prober(self, loop) -> None:
        spec = self.spec
        addrs = self._ring_addresses()
        if addrs is None or self.responder is None:
            return
        peers = {p: addrs[p] for p in watched_peers(spec.rank, spec.world_size)}
        ladder = Ladder(tolerance=spec.probe_tolerance, grace=spec.abort_grace_s)
        window = spec.probe_interval_s * spec.probe_tolerance
        metrics = self.metrics
        if metrics is not None:
            metrics.watch_peers(peers)

        def act(action: str, peer: int) -> None:
            if self.stopping.is_set():
                return  # peers leave one by one during a stop; the stop alarm covers a stop that hangs
            if self.marker is not None:
                self.marker.note(ladder=f"{action} (peer rank {peer}) at {time.strftime('%H:%M:%S')}")
            if metrics is not None:
                metrics.ladder(action, peer)
            who = f"rank {spec.rank}: peer rank {peer}"
            if action == "suspect":
                _say(f"{who} missed {spec.probe_tolerance} probes ({window:g} s): suspect")
            elif action == "abort":
                _say(f"{who}: abort stage: cancelling requests in flight at the next step; "
                     f"re-probing for {spec.abort_grace_s:g} s")
                if spec.rank == 0:
                    self._cancel_held(loop)
            elif action == "recovered":
                _say(f"{who} answers again: serving goes on")
            elif action == "lost":
                self.fatal(PeerLost(f"{who} lost: no probe answer for {window + spec.abort_grace_s:g} s "
                                    f"({spec.probe_tolerance} probes, then {spec.abort_grace_s:g} s of grace)",
                                    peers=(peer,)), state="lost")

        self.prober = Prober(peers, job_token(spec.job_id, spec.nonce), spec.rank, ladder,
                             interval=spec.probe_interval_s, on_action=act).start()

    def _tripped(self, err: ClusterctlError) -> None:
        """The watchdog's verdict. A stale launcher lease first runs the ladder's abort stage (requests in flight
        end as cancelled for their clients, on every rank at the same step), then the rank exits."""

        if isinstance(err, LeaseExpired) and self.loop is not None and self.spec.abort_grace_s > 0:
            self._abort_stage(self.spec.abort_grace_s)
        self.fatal(err)

    def _abort_stage(self, timeout: float) -> None:
        """Cancel every request at the next step boundary and wait (up to ``timeout``) until this rank has
        applied a new cancel epoch and holds no request. Rank 0 writes the cancel; the epoch reaches the others
        with the step."""
        spec, loop = self.spec, self.loop
        before = loop.acked
        if spec.rank == 0 and not self._cancel_held(loop):
            return
        _say(f"rank {spec.rank}: abort stage: cancelling requests in flight (up to {timeout:g} s)")
        deadline = time.monotonic() + timeout
        # applied (a new epoch acked), and the cancelled requests over: generation ended on every rank (tokens
        # agreed) and, on rank 0, the clients got their last event
        while (loop.acked <= before or loop.active.ids()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _cancel_held(self, loop) -> bool:
        """Rank 0: cancel (through its cancel file) every request it holds right now."""

        spec = self.spec
        try:
            cancel_here(spec.runtime_dir, spec.deployment_id, spec.job_id, loop.active.ids(),
                        consumed=loop.cancels.consumed if loop.cancels is not None else 0)
            return True
        except (ClusterctlError, OSError) as e:
            _say(f"rank 0: cannot write the cancel file: {getattr(e, 'message', None) or e}")
            return False


def _read_spec(ns: argparse.Namespace) -> RankSpec:
    if ns.spec:
        if os.environ.get(UNSIGNED_ENV) != "1":
            raise UsageError(f"--spec reads an UNSIGNED spec and needs {UNSIGNED_ENV}=1 (tests only); "
                             "use --contract")
        return load_unsigned_spec(ns.spec)
    if not ns.node:
        raise UsageError("--contract needs --node NAME (the node this rank runs on)")
    return load_rank_contract(ns.contract, ns.node)


def main(argv: list[str] | None = None) -> int:
    # Block the stop signals before any thread exists (mlx's included): one thread sigwait()s for them, so a
    # main thread stuck in a collective cannot delay the stop or the forced exit.
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    ap = argparse.ArgumentParser(prog="python -m clusterctl.rank", description="one clusterctl rank")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--contract", help="signed rank contract file")
    src.add_argument("--spec", help=f"UNSIGNED rank spec (needs {UNSIGNED_ENV}=1; tests only)")
    ap.add_argument("--node", help="this node's name (checked against the contract)")
    ns = ap.parse_args(argv)
    try:
        spec = _read_spec(ns)
        apply_environment(rank_environment(spec, dict(os.environ)))
    except ClusterctlError as e:
        _say(f"error: {e.message}")
        return int(e.exit_code)
    _exit_now(Rank(spec).run())
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
