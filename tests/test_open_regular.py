"""One way to open a file someone else may have placed (atomic.open_regular): the GGUF reader, the PLE shard
reader, the signing key and every capped read use it. A FIFO never blocks the opener, and only a regular file
is returned."""

from __future__ import annotations

import os

import pytest

from clusterctl.atomic import open_regular, read_capped
from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.gguf.reader import read_header
from clusterctl.ple.errors import CorruptTensorFile, TensorNotFound
from clusterctl.ple.shard import ShardFile


def test_a_regular_file_and_a_followed_symlink_open(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    fd, st = open_regular(tmp_path / "f")
    os.close(fd)
    assert st.st_size == 3
    fd, _ = open_regular(tmp_path / "l", follow_symlinks=True)
    os.close(fd)
    with pytest.raises(IntegrityError, match="cannot open"):
        open_regular(tmp_path / "l")  # not followed unless asked


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_fifo_or_a_folder_is_refused_at_once_by_every_reader(tmp_path, kind):
    p = tmp_path / "x"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    with pytest.raises(IntegrityError, match="not a regular file"):
        open_regular(p, follow_symlinks=True)
    with pytest.raises(IntegrityError, match="not a regular file"):
        read_capped(p)
    with pytest.raises(IntegrityError, match="not a regular file"):
        read_header(p)
    with pytest.raises(CorruptTensorFile, match="not a regular file"):
        ShardFile(str(p))


def test_a_missing_file_is_missing_input_in_each_readers_words(tmp_path):
    with pytest.raises(MissingInput, match="not found"):
        open_regular(tmp_path / "nope")
    with pytest.raises(MissingInput, match="GGUF file not found"):
        read_header(tmp_path / "nope")
    with pytest.raises(TensorNotFound, match="shard file not found"):
        ShardFile(str(tmp_path / "nope"))
