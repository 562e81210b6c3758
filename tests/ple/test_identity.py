"""Byte identity: Reader rows == numpy fancy indexing of the same tensor, over shapes, dtypes, offsets, indices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from stfiles import make_cold, random_tensor, write_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterctl.ple import Reader
from clusterctl.ple.residency import PAGE

DTYPES = ["F32", "F16", "BF16", "U8", "I8", "U32", "I64", "F64", "BOOL", "F8_E4M3"]
_count = itertools.count()


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    nrows = draw(st.integers(1, 400))
    ndim = draw(st.integers(0, 2))
    # row sizes from a few bytes to several pages (rows straddling pages and longer than several pages)
    row_shape = tuple(draw(st.lists(st.integers(1, 40 if ndim == 2 else 5000), min_size=ndim, max_size=ndim)))
    pad = draw(st.integers(0, 3 * PAGE))
    gap = draw(st.integers(0, 9))
    kind = draw(st.sampled_from(["random", "sorted", "reversed", "dups", "runs", "single", "empty", "2d"]))
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    cold = draw(st.booleans())
    use_out = draw(st.booleans())
    return dtype, nrows, row_shape, pad, gap, kind, n, seed, cold, use_out


def _indices(rng, kind, n, nrows):
    if kind == "random":
        return rng.integers(0, nrows, n)
    if kind == "sorted":
        return np.sort(rng.integers(0, nrows, n))
    if kind == "reversed":
        return np.arange(nrows)[::-1][:n]
    if kind == "dups":
        return rng.choice(rng.integers(0, nrows, max(1, n // 5)), n).astype(np.int32)
    if kind == "runs":
        s = int(rng.integers(0, nrows))
        return np.concatenate([np.arange(s, min(nrows, s + n)), np.arange(0, min(nrows, 7))]).astype(np.uint16)
    if kind == "single":
        return np.int64(rng.integers(0, nrows))
    if kind == "empty":
        return np.zeros(0, dtype=np.int64)
    return rng.integers(0, nrows, (3, max(1, n // 3))).astype(np.uint32)


@pytest.mark.parametrize("io", ["nowait", "fadvise", "pool"])
def test_rows_are_numpy_fancy_indexing(io, tmp_path_factory, can_evict):
    folder = tmp_path_factory.mktemp(f"ident-{io}")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cases())
    def check(case):
        dtype, nrows, row_shape, pad, gap, kind, n, seed, cold, use_out = case
        rng = np.random.default_rng(seed)
        t = random_tensor(rng, dtype, (nrows, *row_shape))
        other = random_tensor(rng, "U8", (3, 5))
        path = write_safetensors(folder / f"t{next(_count)}.safetensors", {"o": ("U8", other), "t": (dtype, t)},
                                 pad=pad, gap=gap)
        with Reader(path, io=io, window=8, threads=4) as r:
            idx = _indices(rng, kind, n, nrows)
            for rep in range(2):  # first pass cold (if asked), then the same rows warm from seen pages
                if cold and rep == 0:
                    make_cold(r, path)
                # fancy indexing with a 1-D array then reshaped: a 0-d index would give a numpy scalar, which
                # normalizes raw BOOL bytes
                expect = t[np.atleast_1d(idx).reshape(-1)].reshape(np.shape(idx) + t.shape[1:])
                out = np.full(expect.shape, 0x5A, dtype=t.dtype) if use_out else None
                before = r.stats()
                got = r.rows("t", idx, out=out)
                after = r.stats()
                if cold and rep == 0 and expect.size:
                    assert after["cold_rows"] > before["cold_rows"]
                if rep == 1 and expect.size:
                    assert after["cold_rows"] == before["cold_rows"] and after["recoveries"] == 0
                    assert after["warm_rows"] - before["warm_rows"] == np.size(idx)
                assert got.dtype == t.dtype and got.shape == expect.shape
                assert got.flags.c_contiguous
                assert got.tobytes() == expect.tobytes()
                if use_out:
                    assert got is out
        path.unlink()

    check()
