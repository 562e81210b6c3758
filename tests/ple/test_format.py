"""Headers, indexes, sharded checkpoints and tables, quantized tables: real files, clear errors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from stfiles import random_tensor, write_safetensors

from clusterctl.errors import ClusterctlError, IntegrityError, MissingInput
from clusterctl.ple import (
    CorruptTensorFile,
    QuantizedRows,
    Reader,
    TensorNotFound,
    TruncatedTensorFile,
)
from clusterctl.ple.safetensors import INDEX_NAME


def _raw(path, header_bytes: bytes, data: bytes = b"", declared: int | None = None):
    n = len(header_bytes) if declared is None else declared
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return path


@pytest.mark.parametrize("header,data,declared,err", [
    (b"", b"", None, CorruptTensorFile),                                     # 8 bytes, empty header
    (b"{}", b"", 10**12, CorruptTensorFile),                                 # absurd header length
    (b"{}", b"", 40, TruncatedTensorFile),                                   # header longer than the file
    (b"{not json", b"", None, CorruptTensorFile),
    (b"[1, 2]", b"", None, CorruptTensorFile),
    (b"\xff\xfe{}", b"", None, CorruptTensorFile),                            # not UTF-8
    (b'{"t": 5}', b"", None, CorruptTensorFile),
    (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 8, None, CorruptTensorFile),
    (b'{"t": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}', b"\0" * 8, None, CorruptTensorFile),
    (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}', b"\0" * 8, None, CorruptTensorFile),
    (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 5, None, TruncatedTensorFile),
    (b'{"t": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', b"\0" * 4, None, CorruptTensorFile),
    (b'{"t": {"shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, None, CorruptTensorFile),
])
def test_corrupt_headers_are_integrity_errors(tmp_path, header, data, declared, err):
    p = _raw(tmp_path / "bad.safetensors", header, data, declared)
    with pytest.raises(err) as ei:
        Reader(p)
    assert isinstance(ei.value, IntegrityError) and str(p) in ei.value.message


def test_short_file(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(TruncatedTensorFile):
        Reader(p)


def test_tolerant_header_unknown_dtype_and_keys(tmp_path, rng):
    a = random_tensor(rng, "F32", (4, 3))
    p = write_safetensors(tmp_path / "m.safetensors", {"a": ("F32", a)}, metadata={"format": "mlx"})
    hdr = json.loads(p.read_bytes()[8:8 + struct.unpack("<Q", p.read_bytes()[:8])[0]])
    hdr["a"]["extra"] = "ignored"
    hdr["weird"] = {"dtype": "C1024", "shape": [2], "data_offsets": [0, 16]}
    js = json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(js)) + js + a.tobytes())
    with Reader(p) as r:
        assert r.names() == ["a", "weird"]
        assert r.rows("a", [3, 0]).tobytes() == a[[3, 0]].tobytes()
        with pytest.raises(CorruptTensorFile, match="C1024"):
            r.rows("weird", [0])
        with pytest.raises(TensorNotFound):
            r.rows("nope", [0])


def test_info_and_paths(tmp_path, rng):
    a = random_tensor(rng, "BF16", (10, 7))
    p = write_safetensors(tmp_path / "model.safetensors", {"a": ("BF16", a)}, pad=3)
    for where in (p, tmp_path):
        with Reader(where) as r:
            e = r.info("a")
            assert (e.dtype, e.shape, e.row_bytes, e.numpy_dtype) == ("BF16", (10, 7), 14, "<u2")
            assert e.start == 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]
            t = r.table("a")
            assert t.shape == (10, 7) and t.dtype == np.uint16 and len(t) == 10
    with pytest.raises(MissingInput):
        Reader(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TensorNotFound):
        Reader(empty)


def _sharded(tmp_path, rng, nfiles=4):
    weight_map, tensors = {}, {}
    for f in range(nfiles):
        fname = f"model-{f + 1:05d}-of-{nfiles:05d}.safetensors"
        ts = {f"layers.{f}.ple": ("BF16", random_tensor(rng, "BF16", (500 + f, 64))),
              f"layers.{f}.norm": ("F32", random_tensor(rng, "F32", (64,)))}
        write_safetensors(tmp_path / fname, ts, pad=17 * f + 1)
        for n, v in ts.items():
            weight_map[n] = fname
            tensors[n] = v[1]
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return tensors


def test_sharded_checkpoint_and_decode_batch(tmp_path, rng):
    tensors = _sharded(tmp_path, rng)
    with Reader(tmp_path) as r:
        assert set(r.names()) == set(tensors)
        ids = np.array([3, 499, 3, 17])
        got = r.gather_many({f"layers.{f}.ple": ids for f in range(4)})
        for f in range(4):
            assert got[f"layers.{f}.ple"].tobytes() == tensors[f"layers.{f}.ple"][ids].tobytes()
        assert r.stats()["calls"] == 1  # one batched call over four files
        # a 1-D tensor's rows are its elements
        assert r.rows("layers.2.norm", [5, 1]).tobytes() == tensors["layers.2.norm"][[5, 1]].tobytes()
    with Reader(tmp_path / INDEX_NAME) as r:
        assert r.rows("layers.1.ple", [0]).tobytes() == tensors["layers.1.ple"][[0]].tobytes()


def test_index_errors(tmp_path, rng):
    _sharded(tmp_path, rng, nfiles=1)
    idx = tmp_path / INDEX_NAME
    idx.write_text(json.dumps({"weight_map": {"x": "../etc/passwd"}}))
    with pytest.raises(CorruptTensorFile, match="not a file of the folder"):
        Reader(tmp_path)
    idx.write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with Reader(tmp_path) as r, pytest.raises(TensorNotFound, match="missing.safetensors"):
        r.rows("x", [0])
    idx.write_text(json.dumps({"weight_map": {"layers.0.pleX": "model-00001-of-00001.safetensors"}}))
    with Reader(tmp_path) as r, pytest.raises(TensorNotFound, match="index says"):
        r.rows("layers.0.pleX", [0])
    idx.write_text("{oops")
    with pytest.raises(CorruptTensorFile):
        Reader(tmp_path)
    idx.write_text("[]")
    with pytest.raises(CorruptTensorFile, match="weight_map"):
        Reader(tmp_path)


def test_sharded_table_by_row_ranges(tmp_path, rng):
    parts = [random_tensor(rng, "F16", (n, 33)) for n in (100, 1, 250)]
    write_safetensors(tmp_path / "a.safetensors", {"bank.0": ("F16", parts[0]), "bank.1": ("F16", parts[1])},
                      pad=5)
    write_safetensors(tmp_path / "b.safetensors", {"bank.2": ("F16", parts[2])}, pad=2001)
    full = np.concatenate(parts)
    with Reader(tmp_path) as r:
        t = r.table(["bank.0", "bank.1", "bank.2"])
        assert t.shape == (351, 33)
        for idx in ([0, 99, 100, 101, 350, 100, 5], [120, 130, 140], np.arange(351)[::-3], [100]):
            assert t.rows(idx).tobytes() == full[idx].tobytes()
            assert t.rows(idx).tobytes() == full[idx].tobytes()  # warm now
        with pytest.raises(IndexError):
            t.rows([351])
        write_safetensors(tmp_path / "c.safetensors", {"odd": ("F16", random_tensor(rng, "F16", (3, 32)))})
    with Reader(tmp_path) as r, pytest.raises(CorruptTensorFile, match="cannot form one table"):
        r.table(["bank.0", "odd"])


def test_quantized_rows_with_scales_and_biases(tmp_path, rng):
    w = random_tensor(rng, "U32", (300, 16))   # 128 columns of 4 bits, packed
    s = random_tensor(rng, "F16", (300, 2))    # group size 64
    b = random_tensor(rng, "F16", (300, 2))
    w2 = random_tensor(rng, "U32", (20, 16))
    s2 = random_tensor(rng, "BF16", (20, 2))
    write_safetensors(tmp_path / "q.safetensors", {
        "embed.weight": ("U32", w), "embed.scales": ("F16", s), "embed.biases": ("F16", b),
        "mx.weight": ("U32", w2), "mx.scales": ("BF16", s2)}, pad=99)
    ids = np.array([[5, 299], [5, 0]])
    with Reader(tmp_path / "q.safetensors") as r:
        q = r.rows_quantized("embed.weight", ids)
        assert isinstance(q, QuantizedRows)
        assert q.weight.dtype == np.uint32 and q.weight.shape == (2, 2, 16)
        for got, want in zip(q, (w, s, b)):
            assert got.tobytes() == want[ids].tobytes()
        q2 = r.quantized_table("mx").rows([19, 3])
        assert q2.biases is None and q2.scales.dtype == np.uint16
        assert q2.weight.tobytes() == w2[[19, 3]].tobytes() and q2.scales.tobytes() == s2[[19, 3]].tobytes()
        outs = (np.empty((2, 2, 16), np.uint32), np.empty((2, 2, 2), np.float16), np.empty((2, 2, 2), np.float16))
        got = r.gather_many({r.quantized_table("embed"): ids, "mx.weight": [1]}, out={r.quantized_table("embed"): outs})
        assert got[r.quantized_table("embed")].weight is outs[0]
        assert outs[2].tobytes() == b[ids].tobytes()


def test_errors_are_clusterctl_errors():
    for cls in (CorruptTensorFile, TruncatedTensorFile, TensorNotFound):
        assert issubclass(cls, ClusterctlError)
