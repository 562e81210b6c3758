"""A job whose nodes are one machine (one runtime dir for both ranks). `teardown --force` gives each rank one
SIGTERM, never the second one that means "exit now", and a stream cut by the teardown ends with an error event
its client can read, not with silence (docs/launch.md, teardown; docs/rank.md, HTTP API)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launchutil import StreamReader, cli, launch_for_long_requests, manifests, next_event, open_stream

pytestmark = pytest.mark.slow


def test_teardown_force_signals_each_rank_once_and_a_cut_stream_ends_with_an_error_event(tmp_path, tiny, env):
    dep, host, port = launch_for_long_requests(tmp_path, tiny, env, shared_runtime=True)
    [m] = manifests(tmp_path / "state")
    [run] = {r["runtime_dir"] for r in m["ranks"]}
    assert [r["node"] for r in m["ranks"]] == ["a", "b"]
    # opened now: a verified teardown removes the job's files, logs included
    logs = [open(Path(run) / f"{m['job_id']}-rank{r}.log", "rb") for r in (0, 1)]
    conn = None
    try:
        # a cancel reaches this one runtime dir once per node: rank 0 applies it once, and the copy is not news
        cn = cli("cancel", dep, "--all", "--wait", "20", "--json", env=env)
        assert cn.returncode == 0 and json.loads(cn.stdout)["jobs"][0]["all_acked"], cn.stdout + cn.stderr
        conn, r = open_stream(host, port, {"prompt": "def main(argv):", "max_tokens": 3000, "temperature": 0})
        first = next_event(r)  # the first token: it is decoding
        assert isinstance(first, dict) and first["choices"], first
        td = cli("teardown", "--force", "--json", env=env)
        assert td.returncode == 0, td.stderr
        assert json.loads(td.stdout)["ok"] and manifests(tmp_path / "state") == []
        rest = StreamReader(r).events(30)
        assert rest is not None, "the stream neither ended nor was closed after the teardown"
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        last = rest[-2] if len(rest) > 1 else None
        assert isinstance(last, dict) and last.get("error", {}).get("message") == "server is shutting down", rest[-3:]
        assert all(isinstance(e, dict) and e.get("choices") for e in rest[:-2])  # tokens, then the error
        for rank, log in enumerate(logs):
            text = log.read().decode("utf-8", "replace")
            assert "second signal" not in text and "already consumed" not in text, text[-2000:]
            # a rank may stop at the meeting its peer's stop vote reached before its own SIGTERM did
            assert text.count("SIGTERM: stopping") <= 1 and f"rank {rank}: stopped" in text, text[-2000:]
    finally:
        if conn is not None:
            conn.close()
        for log in logs:
            log.close()
        cli("teardown", "--force", env=env)
