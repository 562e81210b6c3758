"""Test helper: a full disk, for real (a file that takes every last byte of a small filesystem)."""

from __future__ import annotations

import os
from pathlib import Path


def fill_disk(folder: Path) -> Path:
    """Fill the filesystem under ``folder`` to the last byte (whole pages, then single bytes) with one file,
    ``folder/filler``; returns its path."""
    path = Path(folder) / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (b"x" * 4096, b"x"):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return path
