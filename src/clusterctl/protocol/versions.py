"""The versions a node reports in its probe and preflight holds it to: python, and clusterctl, mlx and mlx-lm as
installed. One place for the node's report (node/nodeops.py), the coordinator's own (launch/preflight.py) and the
simulated node's (launch/fakecluster.py)."""

from __future__ import annotations

import functools
import sys

from clusterctl import __version__

COMPARED = ("clusterctl", "mlx", "mlx-lm")  # the distributions preflight wants equal on every node


def python_version() -> str:
    """This interpreter's version, ``major.minor.micro``."""
    return ".".join(map(str, sys.version_info[:3]))


def installed(dist: str) -> str | None:
    """The version of distribution ``dist`` installed here, or None."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def node_versions() -> dict[str, str | None]:
    """What a node's probe reports: its python and each of ``COMPARED`` as installed there."""
    return {"python": python_version(), **{dist: installed(dist) for dist in COMPARED}}


@functools.cache
def coordinator_versions() -> dict[str, str | None]:
    """What preflight holds every node to: this coordinator's clusterctl (the code that runs), mlx and mlx-lm.
    Looked up once per command (each lookup walks sys.path), not once per node."""
    return {dist: __version__ if dist == "clusterctl" else installed(dist) for dist in COMPARED}
