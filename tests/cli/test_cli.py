"""The command line's edges: bad flag values found when the command line is parsed (exit 2), failures as one
line with a documented code (never a traceback), and a JSON error document whenever --json was asked for."""

import json
import subprocess

import pytest

from cliutil import run
from modelfiles import make_model


def _one_error_line(r, code):
    assert r.code == code, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if not x.startswith("hint: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > len("error: ") + 5, r.stderr


@pytest.mark.parametrize("argv", [
    ["plan", "-c", "c.toml", "-m", "m", "--headroom-gb", "inf"],
    ["plan", "-c", "c.toml", "-m", "m", "--headroom-gb", "nan"],
    ["plan", "-c", "c.toml", "-m", "m", "--context", "99999999999"],
    ["launch", "dep", "--port", "70000"],
    ["launch", "dep", "--port", "0"],
    ["launch", "dep", "--host", "not an ip;rm"],
    ["launch", "dep", "--timeout", "1e309"],
    ["launch", "dep", "--grace", "-1"],
    ["launch", "dep", "--lease", "nan"],
    ["launch", "dep", "--seed", "-1"],
    ["teardown", "--drain", "inf"],
    ["cancel", "dep", "--all", "--wait", "-inf"],
    ["replan", "--detach", "--foreground"],
    ["sync", "dep", "--jobs", "100000"],
    ["model", "tiny", "x", "--layers", "1000000000"],
])
def test_bad_flag_values_are_usage_errors_with_a_json_document(argv, tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(tmp_path / "state"))
    r = run(*argv, "--json")
    _one_error_line(r, 2)
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2


def test_the_one_command_form_of_front_still_says_clusterctl_front(tmp_path, monkeypatch):
    """`clusterctl front ...` without a subcommand is the command of before (cli/frontcmds.py): its usage errors
    and help name `clusterctl front`, not the hidden command that runs it."""
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(tmp_path / "state"))
    r = run("front", "--no-such-option")
    _one_error_line(r, 2)
    assert "--no-such-option (see clusterctl front --help)" in r.stderr
    r = run("front", "--json", "--help")
    assert r.code == 0 and "Usage: clusterctl front [OPTIONS] [HOST:PORT] [target]" in " ".join(r.stdout.split())


def test_a_bare_clusterctl_prints_its_help_and_no_empty_error():
    r = run()
    assert r.code == 2 and "Usage" in r.stdout + r.stderr and "error:" not in r.stderr
    r = run("model")
    assert r.code == 2 and "error:" not in r.stderr


def test_a_config_with_absurd_sizes_is_a_config_error_not_a_memory_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(tmp_path / "state"))
    m = make_model(tmp_path / "m", layers=4, hidden=64)
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**12
    (m / "config.json").write_text(json.dumps(cfg))
    c = tmp_path / "c.toml"
    c.write_text("[[node]]\nname = 'a'\nmemory_gb = 8\n")
    r = run("plan", "-c", str(c), "-m", str(m), "--json")
    _one_error_line(r, 78)
    assert "num_hidden_layers must be an integer in [1, 1024]" in r.stderr and r.json()["ok"] is False


@pytest.fixture
def mounts(tmp_path):
    made = []

    def mount(name, opts):
        d = tmp_path / name
        d.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
        made.append(d)
        return d

    yield mount
    for d in made:
        subprocess.run(["umount", "-l", str(d)])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["read-only", "full", "proc"])
def test_model_tiny_where_no_file_can_be_written_is_73(where, mounts):
    if where == "proc":
        target = "/proc/clusterctl-test-model"
    else:
        d = mounts(where, "ro,size=1m" if where == "read-only" else "size=300k")
        target = str(d / "m")
    r = run("model", "tiny", target, "--layers", "2", "--hidden", "64", "--json")
    _one_error_line(r, 73)
    assert r.json()["exit_code"] == 73 and f"cannot build the tiny model in {target}" in r.stderr
    if where == "full":
        assert list(d.iterdir()) == []  # nothing half-built left behind


@pytest.mark.slow
def test_model_tiny_names_the_flag_in_its_hint(tmp_path):
    assert run("model", "tiny", str(tmp_path / "m"), "--layers", "2", "--hidden", "64", "-q").code == 0
    r = run("model", "tiny", str(tmp_path / "m"), "--layers", "3", "--hidden", "64")
    assert r.code == 78 and "hint: remove it, or pass --overwrite" in r.stderr


def test_model_import_refuses_a_file_that_is_not_gguf_in_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run("model", "import", str(bad), str(tmp_path / "m"), "--json")
    _one_error_line(r, 65)
    assert r.json()["ok"] is False and not (tmp_path / "m").exists()


def test_a_path_with_an_undecodable_byte_never_breaks_stdout(tmp_path):
    """argv bytes that are not UTF-8 come back as lone surrogates; with --json the error document must still be
    written (valid JSON, the path escaped) under a strict UTF-8 stdout, not end in an internal error (exit 70).
    Found by test_random_combinations[model import]."""
    import json as _json

    from fuzzutil import run_cli

    bad = str(tmp_path / b"\xff\xfe-not-utf8".decode("utf-8", "surrogateescape"))
    r = run_cli(["model", "import", bad, str(tmp_path / "dest"), "--json"])
    assert r.code == 66 and r.stdout_error is None, (r.code, r.stderr[-300:])
    doc = _json.loads(r.stdout)
    assert doc["ok"] is False and "\udcff" in doc["error"]
    r = run_cli(["model", "import", bad, str(tmp_path / "dest")])
    assert r.code == 66 and "not-utf8" in r.stderr and r.stdout_error is None
