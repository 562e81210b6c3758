"""clusterctl.gguf.reader: the header reader checks every length against the file before using it."""

import struct

import numpy as np
import pytest

from clusterctl.errors import IntegrityError
from clusterctl.gguf.reader import read_header
from gguffiles import quantize, write_gguf


def _file(tmp_path, **meta):
    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    tensors = {"a.weight": ("Q8_0", (2, 32), quantize(x, "Q8_0")), "b.weight": ("F16", (3,), quantize(x[0, :3], "F16"))}
    return write_gguf(tmp_path / "h.gguf", {"general.architecture": "llama", "n": 7, "f": 0.5, "b": True,
                                           "s": ["x", "yz"], "i": [1, -2], **meta}, tensors)


def test_reads_metadata_and_tensor_table(tmp_path):
    h = read_header(_file(tmp_path))
    assert h.version == 3 and h.metadata == {"general.architecture": "llama", "n": 7, "f": 0.5, "b": True,
                                             "s": ["x", "yz"], "i": [1, -2]}
    a, b = h.tensors
    assert (a.name, a.shape, a.type, a.nbytes, a.elements) == ("a.weight", (2, 32), "Q8_0", 68, 64)
    assert (b.shape, b.type, b.nbytes) == ((3,), "F16", 6) and a.offset == h.data_offset and b.offset % 32 == 0


@pytest.mark.parametrize("patch, text", [
    (lambda d: b"GGUF" + struct.pack("<I", 1) + d[8:], "version 1"),
    (lambda d: d[:8] + struct.pack("<Q", 1 << 40) + d[16:], "damaged header"),
    (lambda d: d[:16] + struct.pack("<Q", 1 << 19) + d[24:], "more than a file of 390 bytes can hold"),
    (lambda d: d.replace(b"yz", b"\xff\xfe"), "not UTF-8"),
    (lambda d: d[:-1], "truncated"),
])
def test_damaged_headers(tmp_path, patch, text):
    path = _file(tmp_path)
    path.write_bytes(patch(path.read_bytes()))
    with pytest.raises(IntegrityError, match=text):
        read_header(path)


def test_alignment_must_be_a_power_of_two(tmp_path):
    with pytest.raises(IntegrityError, match="alignment"):
        read_header(_file(tmp_path, **{"general.alignment": 24}))


def test_a_folder_is_not_a_gguf(tmp_path):
    with pytest.raises(IntegrityError, match="not a regular file"):
        read_header(tmp_path)


def test_counts_are_bounded_before_anything_is_built(tmp_path):
    """Each count is checked against what the file can hold (and a fixed cap) before a list or string is made."""
    from clusterctl.gguf.reader import MAX_ARRAY, MAX_NAME
    from gguffiles import count_fields

    path = _file(tmp_path, **{"tokenizer.ggml.tokens": ["a"] * 4})
    data = path.read_bytes()
    fields = {what: (off, fmt) for off, fmt, what in count_fields(data)}

    def lie(what, value):
        off, fmt = fields[what]
        path.write_bytes(data[:off] + struct.pack(fmt, value) + data[off + struct.calcsize(fmt):])
        with pytest.raises(IntegrityError) as e:
            read_header(path)
        return e.value.message

    assert f"at most {MAX_ARRAY}" in lie("length of array tokenizer.ggml.tokens", MAX_ARRAY + 1)
    assert "runs past the end" in lie("length of array tokenizer.ggml.tokens", MAX_ARRAY)
    assert "runs past the end" in lie("length of array i", MAX_ARRAY - 1)  # numbers: 4 bytes each
    assert f"(at most {MAX_NAME})" in lie("length of the tensor name a.weight", MAX_NAME + 1)
    assert "(at most 65536)" in lie("length of the key general.architecture", 1 << 40)
    assert "more than a file of" in lie("header: tensor count", 20)


def test_value_types_are_recorded(tmp_path):
    from gguffiles import Typed

    h = read_header(_file(tmp_path, d=Typed(12, 0.25), u=Typed(10, 2**64 - 1)))
    assert h.value_types["d"] == (12,) and h.value_types["s"] == (9, 8) and h.value_types["i"] == (9, 5)
    assert h.metadata["u"] == 2**64 - 1 and h.metadata["d"] == 0.25
