"""bench/ple.py's false-recovery count: pages the kernel evicted behind the reader's back are not false recoveries.

This VM's kernel drops cached pages that nobody maps while nothing asks for memory (a DAMON thread pages out what
it judges cold); the reader then takes real major faults and rightly reports a recovery. The bench used to count
every recovery of its cached-but-unmapped gathers as false. Here the eviction is done on purpose, between the
drop of the mappings and the gather, with POSIX_FADV_DONTNEED: what the reclaim does, but every time.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from clusterctl.ple.residency import evict

BENCH = Path(os.environ.get("PLE_BENCH", Path(__file__).resolve().parents[2] / "bench" / "ple.py"))


@pytest.fixture
def bench(tmp_path, monkeypatch, can_evict):
    spec = importlib.util.spec_from_file_location("bench_ple_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tf = mod.write_table(tmp_path / "t.safetensors", "t", 4096, 8192 * 4096, 1)  # 8192 rows, unaligned start

    class Reclaimed(mod.Reader):
        """A reader whose cached pages the kernel drops after its mappings are dropped, before its next gather."""

        dropped = False

        def drop_mappings(self):
            super().drop_mappings()
            self.dropped = True

        def rows(self, name, indices, out=None):
            if self.dropped:  # by now the reference arm has dropped its mapping too: nobody maps these pages
                evict(tf.path)
                self.dropped = False
            return super().rows(name, indices, out)

    monkeypatch.setattr(mod, "Reader", Reclaimed)
    yield mod, tf
    if mod._REF_POOL is not None:
        mod._REF_POOL.shutdown()


def _false(fr: dict) -> int:
    return sum(v["ple_recoveries"] for v in fr.values())  # what the report sums as "false recoveries"


def test_evictions_behind_the_readers_back_are_not_false_recoveries(bench):
    mod, tf = bench
    fr = mod.false_recoveries(tf, 3, np.random.default_rng(1))
    assert _false(fr) == 0
    for v in fr.values():  # the bench made its premise true: the gather's pages could not be evicted
        if not v["pinned"]:
            pytest.skip(f"cannot pin pages here: {v['why_not_pinned']}")
        assert v["pages_evicted_before"] == 0 and v["ple_real_recoveries"] == 0


def test_unpinned_evictions_are_counted_as_real(bench):
    mod, tf = bench
    if mod.system_major_faults() is None:
        pytest.skip("no /proc/vmstat here: evictions during a gather cannot be witnessed")
    fr = mod.false_recoveries(tf, 3, np.random.default_rng(1), pin=False, scenarios=("cached-unmapped",))
    v = fr["cached-unmapped"]
    assert not v["pinned"]
    # the eviction lands after the bench's mincore check, inside the gather: only the system's count witnesses it
    assert v["ple_real_recoveries"] >= 1 and v["ple_recoveries"] == 0
