"""The open-file limit the CLI sets is the one its commands run with (issue 41 item 8): importing mlx-lm (plan's
model check) must not lower it. mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096) at import, which capped a
1,000-node launch at ~987 connections and could never be raised again in the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launchutil import local_cluster

# The CLI's own entry, then the limits before and after: a separate process, since this one has mlx-lm loaded.
PROBE = """
import json, resource, sys
from clusterctl import cli
from clusterctl.connect.fdlimit import raise_nofile
raise_nofile()
before = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "before": before, "after": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "mlx_lm": "mlx_lm.utils" in sys.modules}))
"""


def test_plan_runs_with_the_limit_the_cli_set(tmp_path, tiny, env):
    c = local_cluster(tmp_path)
    p = subprocess.run([sys.executable, "-c", PROBE, "plan", "-c", str(c), "-m", str(tiny), "--context", "256",
                        "-o", str(tmp_path / "d.json"), "-q"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300, stdin=subprocess.DEVNULL)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["code"] == 0, p.stderr
    assert got["mlx_lm"], "plan no longer imports mlx-lm: this test checks nothing"
    assert got["after"] == got["before"], got
