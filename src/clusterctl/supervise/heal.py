"""The heal (docs/heal.md, "What a heal does"): a loss stops every rank of the job verified (``lose``: the nodes it
leaves out said and recorded first), and the next step replans on the nodes that answer a probe with ``replan``'s
own rules and relaunches on the same address (``heal``), when the budget allows (supervise/policy.py). ``apply``
swaps a proposal in, records it in the history (kind ``heal``, or ``rejoin``: supervise/rejoin.py) and launches
it. A plan that does not fit, or no node that answers: ``degraded`` with the reason."""

from __future__ import annotations

import asyncio
import contextlib

from clusterctl.connect.nodes import close_all, handles
from clusterctl.errors import Busy, ClusterctlError, MissingInput
from clusterctl.launch.foreground import Running
from clusterctl.launch.replan import (PlanChange, Proposal, changes_of, deployment_ref, lock_for, propose, record,
                                      write_new)
from clusterctl.launch.start import launch as launch_job
from clusterctl.launch.teardown import teardown_command
from clusterctl.supervise.persist import Job, Supervision
from clusterctl.supervise.policy import HealNodes, heal_nodes
from clusterctl.supervise.watch import LOOK_TIMEOUT, Loss

UNREACHABLE_CONNECT = 1.0  # the teardown's connection to a node that stopped answering


async def lose(s: Supervision, loss: Loss) -> None:
    """The job lost a rank or a node: stop every rank verified; the next step heals without the nodes to blame,
    as said and recorded first (one value: a successor finishes the heal if this one dies in the teardown)."""
    plan = s.pending = heal_nodes(s.node_order, s.book.lost, loss.blame)
    s.phase("healing", f"{loss.why}; {plan.words()}")
    await stop_job(s, unreachable=frozenset(n for n in loss.blame if s.seen.unreachable.get(n)))


async def stop_job(s: Supervision, unreachable: frozenset[str] = frozenset()) -> bool:
    """Every rank of the job stopped verified; False (the job noted, retried later) when not confirmed.
    ``unreachable``: nodes whose sessions stopped answering: the teardown asks them over new ones, which give up
    within LOOK_TIMEOUT, instead of waiting on a dead connection."""
    job, s.job = s.job, None
    await s.seen.close()
    if job is None:
        return True
    m = job.manifest
    try:
        if job.running is not None:
            _fresh_handles(s, job.running, unreachable)
            report = await job.running.teardown(lost_nodes=unreachable)
        else:
            [report] = await teardown_command(s.state, m.job_id, s.ssh(), grace=s.opts.grace, force=True, log=s.log)
    except ClusterctlError as e:
        s.log(f"heal: teardown of job {m.job_id}: {e.message}")
        s.leftovers.append(m.job_id)
        return False
    if not report.ok:  # ranks on a node that does not answer: that node is left out; retried later
        s.log(f"heal: teardown of job {m.job_id} could not confirm: {'; '.join(report.survivors())}")
        s.leftovers.append(m.job_id)
    return report.ok


def _fresh_handles(s: Supervision, running: Running, nodes: frozenset[str]) -> None:
    if not nodes:
        return
    old = {n: running.hs[n] for n in nodes if n in running.hs}
    # it has just not answered for the grace: one more second to connect, then its ranks are "unreachable"
    # (the job's manifest is kept, its teardown retried once the node answers again)
    running.hs.update(handles([n for n in running.manifest.nodes if n.name in old], s.ssh(UNREACHABLE_CONNECT)))
    asyncio.ensure_future(_quietly(close_all(old)))  # a dead connection: not awaited


async def retry_leftovers(s: Supervision) -> None:
    for job_id in list(s.leftovers):
        try:
            reports = await teardown_command(s.state, job_id, s.opts.ssh, grace=s.opts.grace, force=True, log=s.log)
        except MissingInput:  # no manifest left: nothing of it to stop
            reports = []
        except ClusterctlError:
            continue
        if all(r.ok for r in reports):
            s.leftovers.remove(job_id)


async def heal(s: Supervision, now: float) -> None:
    """Replan on the nodes that answer (the blamed ones left out) and relaunch, when the budget allows. A loss
    that blames every node of the job found no culprit: every one is asked, those that answer serve again (the
    same plan when all do: a relaunch, no plan change, nothing spent from the budget)."""
    plan = s.pending
    if not plan.ask:  # every node is lost: nothing to heal onto; the rejoin probes bring them back
        s.pending = None
        s.phase("degraded", f"every node is lost ({', '.join(s.book.lost)}), probed for the rejoin")
        return
    asked, no_culprit = list(plan.ask), plan.no_culprit
    if not no_culprit and _held(s, now):
        return
    # a node that answered the last look of the lost job just now needs no probe of its own (one SSH
    # connection and one Python start-up less before the relaunch); the others are asked
    fresh = {n for n in asked if s.seen.unreachable.get(n) is False}
    s.seen.unreachable = {}
    answers = await s.probe([n for n in asked if n not in fresh]) if set(asked) - fresh else {}
    nodes = [n for n in asked if n in fresh or answers.get(n)]
    leave_out = [n for n in asked if n not in nodes] if no_culprit else list(plan.leave_out)
    if no_culprit and leave_out and _held(s, s.clock()):
        return
    s.book.healed(now, leave_out, plan_change=bool(leave_out))
    lost = ", ".join(s.book.lost) or "none"
    if not nodes:
        s.pending = retry(s)  # tried again after the backoff
        s.phase("degraded", f"no node answers a probe ({', '.join(asked)}; lost: {lost})")
        return
    try:
        p = await asyncio.to_thread(propose, s.state, s.ref, PlanChange(nodes=nodes))
    except ClusterctlError as e:
        s.pending = None  # nothing to do until a lost node is back: the rejoin probes it
        s.phase("degraded", f"the model does not fit on {', '.join(nodes)} ({lost} lost): {e.message}")
        return
    if await apply(s, p, "heal"):
        s.pending = None
        s.phase("serving", f"on {', '.join(nodes)}; {lost} lost, probed for the rejoin" if s.book.lost
                else f"on {', '.join(nodes)}; relaunched (no node to blame)")
    else:
        s.pending = retry(s)
        if not leave_out:  # a relaunch that failed: the next one waits for the backoff like any other
            s.book.changes.append(now)


def retry(s: Supervision) -> HealNodes:
    """A heal tried again (after the backoff): every node of the job not lost is asked."""
    return heal_nodes(s.node_order, s.book.lost)


def _held(s: Supervision, now: float) -> bool:
    """The budget holds a plan change back: ``degraded``, said once (a countdown would rewrite the state file),
    what went wrong staying in front (a failed launch, the loss)."""
    wait = s.book.wait(now)
    if wait <= 0:
        return False
    if not s.held:
        said = s.book.reason or "not serving"
        s.phase("degraded", f"{said}; no heal for {wait:.0f} s: {s.book.why_waiting(now)}")
        s.held = True
    return True


async def apply(s: Supervision, p: Proposal, kind: str) -> bool:
    """Swap in the new deployment (unless it is the current one), record it in the history as ``kind``, launch
    it. False (and ``degraded`` with the reason) when that fails."""
    try:
        lock = lock_for(s.state, p)
    except Busy as e:
        s.phase("degraded", f"{kind} waits: {e.message}")
        return False
    try:
        unchanged = p.diff.nothing_to_do
        if not unchanged:
            await asyncio.to_thread(lambda: write_new(s.state, p).commit())
        ref = deployment_ref(p)
        s.ref, s.current = ref, p.new.deployment_id
        s.save(force=True)  # the state file names what now is current (a successor resumes from it)
        job = None
        try:
            job = s.job = await launch(s, ref)
        except ClusterctlError as e:
            s.phase("degraded", f"{kind} to {p.new.deployment_id} did not launch: {e.message}")
            return False
        finally:  # the file names the new deployment now, so does the history: also when a stop cut the launch
            if not unchanged:  # short (teardown, SIGTERM), after which ``launch FILE`` starts that deployment
                record(s.state, p, changes=changes_of(p), relaunched=job and job.manifest.job_id, kind=kind)
        return True
    finally:
        lock.release()


async def launch(s: Supervision, ref: str) -> Job:
    """``ref`` launched on the cluster's address (detached or in the foreground, as this supervisor relaunches)."""
    running = await launch_job(ref, s.state, s.launch_options(), log=s.log)
    s.address = s.address.pinned(running.manifest)  # every relaunch binds the same port
    return Job(running.manifest, None if s.detach else running)


async def _quietly(aw) -> None:
    """Close what may hang (a dead connection) in the background, within LOOK_TIMEOUT, never an error."""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(aw, LOOK_TIMEOUT)
