import json
import os
import subprocess
import sys

import pytest

from cliutil import run, run_process
from clusters import THREE, write_cluster


@pytest.fixture
def c3(tmp_path):
    return write_cluster(tmp_path / "cluster.toml", THREE)


def test_plan_json_is_the_only_stdout(c3, model32, state):
    r = run("plan", "-c", str(c3), "-m", str(model32), "--allocation", "proportional", "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["schema_version"] == 2
    assert [x["layers"] for x in doc["ranks"]] == [5, 11, 16]
    assert (state / "deployments" / f"{doc['deployment_id']}.json").exists()


def test_plan_table_shows_the_same(c3, model32, state):
    r = run("plan", "-c", str(c3), "-m", str(model32), "--allocation", "proportional")
    assert r.code == 0 and r.stdout == ""
    lines = [line.split() for line in r.stderr.splitlines()]
    rows = [line for line in lines if line and line[0] in ("0", "1", "2")]
    assert [row[3] for row in rows] == ["5", "11", "16"]
    assert "[27," in r.stderr and "[0, 16)" in r.stderr
    assert "allocation proportional: asked for" in r.stderr


def test_plan_allocation_defaults_to_auto(c3, model32, state):
    r = run("plan", "-c", str(c3), "-m", str(model32), "--json")
    doc = r.json()
    assert (doc["allocation"], doc["options"]["allocation"], doc["schedule"]) == ("work", "auto", "overlap")
    assert "slowest sets the pace" in doc["allocation_reason"]


def test_quiet_prints_nothing(c3, model32, state):
    r = run("plan", "-c", str(c3), "-m", str(model32), "-q")
    assert r.code == 0 and r.stdout == "" and r.stderr == ""


def test_out_writes_signed_file_and_verify(c3, model32, state, tmp_path):
    out = tmp_path / "dep.json"
    assert run("plan", "-c", str(c3), "-m", str(model32), "--out", str(out), "-q").code == 0
    r = run("verify", str(out), "--json")
    assert r.code == 0 and r.json()["ok"] is True
    data = bytearray(out.read_bytes())
    i = data.index(b'"layers": 11') + len('"layers": 1')
    data[i] = ord("2")
    out.write_bytes(bytes(data))
    r = run("verify", str(out))
    assert r.code == 65
    assert len(r.stderr.strip().splitlines()) == 1 and "signature does not match" in r.stderr


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs: a real full disk (needs root and mount)."""
    d = tmp_path / "small"
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)])


def test_full_disk_keeps_old_file(c3, model32, state, tiny_fs):
    out = tiny_fs / "dep.json"
    out.write_text("old contents")
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    r = run("plan", "-c", str(c3), "-m", str(model32), "--out", str(out))
    assert r.code == 73, r.stderr
    assert "cannot write" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert out.read_text() == "old contents"
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["dep.json", "filler"]  # no temp file left behind


def test_out_into_a_missing_parent_on_a_file_is_73(c3, model32, state, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("plan", "-c", str(c3), "-m", str(model32), "--out", str(blocker / "dep.json"))
    assert r.code == 73 and "cannot" in r.stderr
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("args,code,message", [
    (["--allocation", "weird"], 2, "--allocation: 'weird' is not valid"),
    (["--backend", "nccl"], 2, "--backend: 'nccl' is not valid"),
    (["--parallel", "tensor", "--allocation", "proportional"], 78, "pipeline-only"),
    (["--backend", "jaccl"], 78, "jaccl: node a has no rdma link to node b"),
    (["--context", "16000000", "--batch", "8"], 78, "does not fit"),
])
def test_refusals(c3, model32, state, args, code, message):
    r = run("plan", "-c", str(c3), "-m", str(model32), *args)
    assert r.code == code, r.stderr
    assert message in r.stderr
    assert r.stdout == ""


def test_missing_inputs_66(tmp_path, model32, state, c3):
    assert run("plan", "-c", str(tmp_path / "none.toml"), "-m", str(model32)).code == 66
    assert run("plan", "-c", str(c3), "-m", str(tmp_path / "nomodel")).code == 66
    assert run("verify", str(tmp_path / "none.json")).code == 66


def test_json_error_document(tmp_path, model32, state):
    r = run("plan", "-c", str(tmp_path / "none.toml"), "-m", str(model32), "--json")
    doc = r.json()
    assert r.code == 66 and doc["ok"] is False and doc["exit_code"] == 66 and "schema_version" in doc


def test_usage_errors_are_2():
    r = run("plan", "--no-such-flag")
    assert r.code == 2


def test_version_and_help():
    from clusterctl import __version__

    r = run("--version")
    assert r.code == 0 and r.stdout.strip() == f"clusterctl {__version__}"
    r = run("--help")
    assert r.code == 0 and "plan" in r.stdout and "verify" in r.stdout
    r = run("plan", "--help")
    assert r.code == 0 and "--allocation" in r.stdout


def test_verify_does_not_import_mlx_or_numpy(c3, model32, state, tmp_path):
    out = tmp_path / "d.json"
    assert run("plan", "-c", str(c3), "-m", str(model32), "--out", str(out), "-q").code == 0
    code = ("import sys\nfrom clusterctl.cli import main\n"
            "try:\n    main(['verify', sys.argv[1], '-q'])\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = sorted(m for m in ('mlx', 'mlx_lm', 'numpy', 'asyncssh') if m in sys.modules)\n"
            "print(code, heavy)\n")
    p = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                       env={**os.environ, "CLUSTERCTL_STATE_DIR": str(state)})
    assert p.stdout.strip() == "0 []", p.stderr


def test_local_node_without_memory_gb_reads_this_machine(tmp_path, model32, state):
    import psutil

    c = write_cluster(tmp_path / "c.toml", "[[node]]\nname = 'solo'\n")
    r = run("plan", "-c", str(c), "-m", str(model32), "--json")
    assert r.code == 0, r.stderr
    assert abs(r.json()["nodes"][0]["memory_gb"] - psutil.virtual_memory().total / 2**30) < 0.01


def test_plan_records_the_model_manifest(c3, model32, state):
    from clusterctl.modelfiles.manifest import build_manifest, load_manifest

    r = run("plan", "-c", str(c3), "-m", str(model32), "--json")
    assert r.code == 0, r.stderr
    digest = r.json()["model"]["manifest_hash"]
    assert digest == build_manifest(model32, use_cache=False).manifest_hash
    stored = load_manifest(state / "manifests", digest)
    assert stored is not None and {f.path for f in stored.files} == {p.name for p in model32.iterdir()}


def test_plan_refuses_a_model_folder_whose_files_live_elsewhere(c3, model32, state, tmp_path):
    outside = tmp_path / "blob"
    outside.write_text("{}")
    (model32 / "tokenizer.json").symlink_to(outside)  # absolute target: not the same file on another node
    r = run("plan", "-c", str(c3), "-m", str(model32))
    assert r.code == 65 and "absolute target" in r.stderr and "cp -rL" in r.stderr
    assert not (state / "deployments").exists() or not list((state / "deployments").iterdir())


def test_schedule_and_prompt_cache_are_planned_and_shown(c3, model32, state):
    """overlap by default for a split pipeline (with why), lockstep on request; the prompt cache's reserve is in
    every rank's budget and its tokens in the file; overlap where it cannot apply is refused."""
    r = run("plan", "-c", str(c3), "-m", str(model32), "--json")
    doc = r.json()
    assert r.code == 0 and doc["schedule"] == "overlap" and doc["schedule_reason"]
    assert doc["options"]["prompt_cache_gb"] == 0.25 and doc["prompt_cache_tokens"] > 0
    assert all(x["planned"]["prompt_cache"] == 1 << 28 for x in doc["ranks"])
    r = run("plan", "-c", str(c3), "-m", str(model32), "--schedule", "lockstep", "--prompt-cache-gb", "0")
    assert r.code == 0 and "schedule lockstep: asked for" in r.stderr and "prompt cache" not in r.stderr
    r = run("plan", "-c", str(c3), "-m", str(model32), "--parallel", "tensor", "--schedule", "overlap")
    assert r.code != 0 and "--schedule overlap" in r.stderr and len(r.stderr.strip().splitlines()) <= 2
    r = run("plan", "-c", str(c3), "-m", str(model32), "--schedule", "sideways")
    assert r.code == 2 and "auto, overlap, lockstep" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("template, message", [
    ("{{ ('x' * 300000000)|length }}", "a repeated str of 300,000,000 characters"),
    ("{{ (['ab'] * 30000000)|join }}", "a repeated list of"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "took over 10 s"),
])
def test_a_chat_template_past_rank_0s_bounds_is_refused_and_nothing_written(c3, model32, state, tmp_path,
                                                                             template, message):
    """Issue 41 item 7: a template that only compiled was accepted; plan now renders a sample conversation under
    rank 0's caps and budget (replan shares the option's check)."""
    evil = tmp_path / "evil.jinja"
    evil.write_text(template)
    out = tmp_path / "dep.json"
    r = run("plan", "-c", str(c3), "-m", str(model32), "--chat-template", str(evil), "-o", str(out))
    assert r.code == 78, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr and "sample conversation" in r.stderr
    assert not out.exists() and not list((state / "deployments").glob("*.json"))


def test_a_chat_template_that_refuses_the_sample_conversation_is_still_accepted(c3, model32, state, tmp_path):
    t = tmp_path / "no-system.jinja"
    t.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = run("plan", "-c", str(c3), "-m", str(model32), "--chat-template", str(t), "-q")
    assert r.code == 0, r.stderr
