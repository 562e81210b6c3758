"""ssh_policy: target validation, the options it builds, and those options against real ssh/rsync/sshd."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from clusterctl.errors import AuthRejected, ConfigError, Exit
from clusterctl.connect import ssh_policy
from clusterctl.connect.ssh_policy import SshTarget

NASTY = "dir with space; $(touch {canary}) `touch {canary}` 'single' \"double\" \\back\nnewline"


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/x", "-p", "a b", "a\tb", "a\nb", "bad\x00host",
                                  "x\x7f", "", "root@host", "host:22", "host/path", "[::1]", "a;b", "$(id)"])
def test_bad_hosts_are_refused(host):
    with pytest.raises(ValidationError):
        SshTarget(host=host)


@pytest.mark.parametrize("host", ["node1", "mac-studio.local", "10.0.0.5", "::1", "fe80::1", "a_b", "x"])
def test_plain_hosts_are_accepted(host):
    assert SshTarget(host=host).host == host


@pytest.mark.parametrize("user", ["-l", "a b", "root@x", "a:b", ""])
def test_bad_users_are_refused(user):
    with pytest.raises(ValidationError):
        SshTarget(host="n", user=user)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_accepted_host_is_safe_as_an_argument(host):
    try:
        t = SshTarget(host=host)
    except ValidationError:
        return
    assert not t.host.startswith("-")
    assert not any(c.isspace() or ord(c) < 32 for c in t.host)
    assert "@" not in t.host and "/" not in t.host


def test_unknown_fields_are_refused():
    with pytest.raises(ValidationError):
        SshTarget(host="n", strict_host_key_checking="no")


def test_connect_kwargs_always_verify_host_keys(tmp_path):
    kh = tmp_path / "known_hosts"
    missing = ssh_policy.asyncssh_connect_kwargs(SshTarget(host="n", known_hosts=kh))
    assert missing["known_hosts"] == b""  # an empty trust list, not None (None would turn checking off)
    kh.write_text("")
    present = ssh_policy.asyncssh_connect_kwargs(SshTarget(host="n", port=2222, user="u", known_hosts=kh,
                                                           connect_timeout=3, keepalive_interval=5,
                                                           keepalive_count_max=2))
    assert present["known_hosts"] == str(kh)
    assert present["port"] == 2222 and present["username"] == "u"
    assert present["connect_timeout"] == 3 and present["keepalive_interval"] == 5
    assert present["keepalive_count_max"] == 2
    assert present["agent_forwarding"] is False and present["password_auth"] is False


def test_default_known_hosts_is_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ssh_policy.known_hosts_path(SshTarget(host="n")) == tmp_path / ".ssh" / "known_hosts"


def test_ssh_command_options():
    t = SshTarget(host="n", port=2201, user="me", identity_file=Path("/k/id"), known_hosts=Path("/k/kh"),
                  connect_timeout=7.0, keepalive_interval=11, keepalive_count_max=4)
    argv = ssh_policy.ssh_command(t)
    assert argv[:3] == ["ssh", "-p", "2201"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert "StrictHostKeyChecking=yes" in opts and "BatchMode=yes" in opts
    assert "UserKnownHostsFile=/k/kh" in opts and "ConnectTimeout=7" in opts
    assert "ServerAliveInterval=11" in opts and "ServerAliveCountMax=4" in opts
    assert argv[argv.index("-i") + 1] == "/k/id" and argv[argv.index("-l") + 1] == "me"
    accept = ssh_policy.ssh_command(t.model_copy(update={"accept_new_host_keys": True}))
    assert "StrictHostKeyChecking=accept-new" in accept
    assert "n" not in argv  # the host is the caller's (rsync's) to append


def test_rsync_operand_quotes_the_path():
    t = SshTarget(host="node1")
    assert ssh_policy.rsync_remote_operand(t, "/a b/c") == "node1:'/a b/c'"
    assert ssh_policy.rsync_remote_operand(SshTarget(host="::1"), "/x") == "[::1]:/x"
    for bad in ["/a*", "/a?", "/a[1]", ""]:
        with pytest.raises(ConfigError):
            ssh_policy.rsync_remote_operand(t, bad)


def test_remember_host_key_appends_once(tmp_path):
    kh = tmp_path / "sub" / "known_hosts"
    t = SshTarget(host="10.0.0.1", port=2200, known_hosts=kh, accept_new_host_keys=True)
    ssh_policy.judge_unlisted_host_key(t, host_listed=False, key_line="ssh-ed25519 AAAAC3 comment",
                                       fingerprint="ssh-ed25519 SHA256:x")
    ssh_policy.remember_host_key(t, "ssh-ed25519 AAAAC3")
    assert kh.read_text() == "[10.0.0.1]:2200 ssh-ed25519 AAAAC3\n"
    assert oct(kh.stat().st_mode & 0o777) == "0o600"
    kh.write_text("other ssh-ed25519 BBBB")  # no trailing newline: the entry must not be glued to it
    ssh_policy.remember_host_key(t, "ssh-ed25519 AAAAC3")
    assert kh.read_text().splitlines() == ["other ssh-ed25519 BBBB", "[10.0.0.1]:2200 ssh-ed25519 AAAAC3"]


def test_judge_refuses_unknown_and_changed_keys(tmp_path):
    t = SshTarget(host="n1", known_hosts=tmp_path / "kh")
    with pytest.raises(AuthRejected) as unknown:
        ssh_policy.judge_unlisted_host_key(t, host_listed=False, key_line="ssh-ed25519 A", fingerprint="FP1")
    assert unknown.value.exit_code == Exit.NOPERM
    assert "not known" in unknown.value.message and "FP1" in unknown.value.message
    assert "ssh-keyscan -p 22 n1 >>" in unknown.value.hint and "--accept-new-host-keys" in unknown.value.hint
    accept = t.model_copy(update={"accept_new_host_keys": True})
    with pytest.raises(AuthRejected) as changed:
        ssh_policy.judge_unlisted_host_key(accept, host_listed=True, key_line="ssh-ed25519 A", fingerprint="FP2")
    assert "CHANGED" in changed.value.message and "ssh-keygen -R" in changed.value.hint
    assert not (tmp_path / "kh").exists()


# ---------------------------------------------------------------------------------------------- real ssh, rsync

def _ssh(target: SshTarget, *remote: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*ssh_policy.ssh_command(target), target.host, *remote], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=30, **kw)


@pytest.mark.slow
def test_ssh_command_with_real_openssh(sshd, tmp_path):
    # A known_hosts path with spaces, quotes and % must survive OpenSSH's own option parsing.
    kh = tmp_path / "k h'\"%d" / "known hosts"
    kh.parent.mkdir()
    shutil.copy(sshd.known_hosts, kh)
    r = _ssh(sshd.target(known_hosts=kh), "echo", "ok")
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    r = _ssh(sshd.target(known_hosts=empty), "echo", "ok")
    assert r.returncode == 255 and "Host key verification failed" in r.stderr

    r = _ssh(sshd.target(known_hosts=empty, accept_new_host_keys=True), "echo", "ok")
    assert r.returncode == 0, r.stderr
    assert empty.read_text().strip(), "accept-new must record the key"
    r = _ssh(sshd.target(known_hosts=empty), "echo", "again")  # now strict checking passes
    assert r.returncode == 0 and r.stdout == "again\n"


@pytest.mark.slow
def test_rsync_with_a_hostile_remote_path(sshd, tmp_path):
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")
    canary = tmp_path / "canary"
    weird = tmp_path / NASTY.format(canary=canary).replace("/", "_")
    weird.mkdir()
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(3000))
    t = sshd.target()
    env = {**os.environ, **ssh_policy.RSYNC_ENV}
    push = subprocess.run(["rsync", "-a", "-e", ssh_policy.rsync_rsh(t), "--", str(src),
                           ssh_policy.rsync_remote_operand(t, f"{weird}/")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert push.returncode == 0, push.stderr
    assert (weird / "payload.bin").read_bytes() == src.read_bytes()
    back = tmp_path / "back"
    back.mkdir()
    pull = subprocess.run(["rsync", "-a", "-e", ssh_policy.rsync_rsh(t), "--",
                           ssh_policy.rsync_remote_operand(t, f"{weird}/payload.bin"), f"{back}/"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert pull.returncode == 0, pull.stderr
    assert (back / "payload.bin").read_bytes() == src.read_bytes()
    assert not canary.exists(), "a remote shell executed part of the path"



# As cron runs clusterctl in a container: no USER or LOGNAME, and a uid the password database does not know (a
# mount namespace whose /etc/passwd is empty and whose nsswitch.conf reads only files).
NO_USER_PROBE = """
import asyncio, json
from clusterctl.errors import ClusterctlError
from clusterctl.connect import sshnode
from clusterctl.connect.ssh_policy import SshTarget
try:
    asyncio.run(sshnode.connect(SshTarget(host="127.0.0.1", port=9, user="deploy", connect_timeout=5)))
    print(json.dumps({"kind": "connected"}))
except ClusterctlError as e:
    print(json.dumps({"kind": type(e).__name__, "code": int(e.exit_code), "message": e.message}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_an_unknown_local_user_is_one_line_naming_the_user_to_set(tmp_path):
    import json
    import sys

    (tmp_path / "passwd").write_text("")
    (tmp_path / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME", "LNAME", "USERNAME")}
    script = (f"mount --bind {tmp_path}/passwd /etc/passwd && mount --bind {tmp_path}/nsswitch.conf "
              f"/etc/nsswitch.conf && exec {shlex.quote(sys.executable)} -c \"$PROBE\"")
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                       env={**env, "PROBE": NO_USER_PROBE})
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["kind"] == "ConfigError" and got["code"] == int(Exit.CONFIG), got
    assert "USER=deploy" in got["message"] and "deploy@127.0.0.1:9" in got["message"], got
