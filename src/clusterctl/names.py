"""Names and identifiers that become file names (deployment and job ids, cluster and node names).

They are checked where they are parsed, by the same pattern whoever wrote or signed the file: a signature proves
who wrote a file, not that its id is safe to use in a path. Nothing that passes can hold a ``/``, start with a
``.`` or ``-``, or run long enough to overflow a file name with the suffixes added to it.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"  # cluster and node names (cluster.toml)
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$"  # job ids (<deployment>-<yyyymmddHHMMSS>-<6 hex>)
# a deployment id (<cluster>-<hash>) leaves room for the 22 characters a job id adds to it
DEPLOYMENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,177}$"
NAME_RE = re.compile(NAME_PATTERN)
ID_RE = re.compile(ID_PATTERN)

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
Ident = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
DeploymentIdent = Annotated[str, StringConstraints(pattern=DEPLOYMENT_ID_PATTERN)]


def clip(value: str, limit: int = 80) -> str:
    """A value echoed in a message, cut to ``limit`` characters (a 1 MB name is not printed whole)."""
    value = str(value)
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"
