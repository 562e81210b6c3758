"""Rank 0's serving phase moves one way (rank/api/phase.py): a stop that comes in while the rank is still loading
is not undone when loading ends, a failure is not turned back into a stop, and many threads writing at once leave
the phase a legal one."""

import threading

from clusterctl.rank.api.phase import Phase, ServingPhase


def test_a_stop_during_loading_survives_the_end_of_loading():
    p = ServingPhase()
    assert p.to(Phase.STOPPING)
    assert not p.to(Phase.READY) and not p.to(Phase.SERVING)  # what runtime.py's re-check used to patch back
    assert p.now is Phase.STOPPING and not p.serving


def test_the_phases_in_order_and_a_failure_is_final():
    p = ServingPhase()
    assert p.now is Phase.LOADING and not p.serving
    assert p.to(Phase.READY) and not p.serving and not p.to(Phase.LOADING)
    assert p.to(Phase.SERVING) and p.serving
    assert not p.to(Phase.SERVING)  # already there
    assert p.to(Phase.FAILED)
    assert not p.to(Phase.STOPPING) and not p.to(Phase.SERVING) and p.now is Phase.FAILED


def test_writers_racing_end_past_serving():
    for _ in range(200):
        p = ServingPhase()
        start = threading.Barrier(3)

        def write(phase):
            start.wait()
            p.to(phase)

        ts = [threading.Thread(target=write, args=(ph,)) for ph in (Phase.SERVING, Phase.STOPPING, Phase.SERVING)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert p.now is Phase.STOPPING  # whatever the order: serving never wins over a stop
