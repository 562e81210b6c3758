"""The front door's pure parts: HOST:PORT, the access rules, the endpoint it reaches, the heal state reader."""

from __future__ import annotations

import json
from types import SimpleNamespace as N

import pytest

from clusterctl.statedir.state import StateDir
from clusterctl.front.follow import reachable
from clusterctl.protocol.httpedge import Access, Cors, Keys
from clusterctl.front.records import parse_front, url_of
from clusterctl.statedir.healfile import read_state as read_heal


@pytest.mark.parametrize("value,want", [("127.0.0.1:8080", ("127.0.0.1", 8080)), ("[::1]:80", ("::1", 80)),
                                        ("front.lan:65535", ("front.lan", 65535)), ("0.0.0.0:1", ("0.0.0.0", 1))])
def test_parse_front(value, want):
    assert parse_front(value) == want
    assert url_of(*want) == ("http://[::1]:80" if want[0] == "::1" else f"http://{value}")


@pytest.mark.parametrize("value", ["8080", ":8080", "host:", "host:0", "host:65536", "host:x", "::1:80",
                                   "bad host:80", "a;b:80", "[::1]:-1"])
def test_parse_front_refuses(value):
    with pytest.raises(ValueError):
        parse_front(value)


def test_rules_keys_and_cors():
    r = Access(Keys((("a", b"k" * 16), ("b", b"j" * 16))), Cors(("https://a.example",)))
    assert r.authorized("Bearer " + "k" * 16) and r.authorized("Bearer " + "j" * 16)
    assert not r.authorized(None) and not r.authorized("Bearer nope") and not r.authorized("k" * 16)
    assert r.cors.headers("https://a.example") == {"Access-Control-Allow-Origin": "https://a.example",
                                                   "Vary": "Origin"}
    assert r.cors.headers("https://b.example") == {} and r.cors.preflight_headers(None) == {}
    assert Access().authorized(None) and Cors(("*",)).headers("x") == {"Access-Control-Allow-Origin": "*"}


def test_reachable():
    m = lambda ep, local, host: N(endpoint=ep, ranks=[N(local=local, host=host)])  # noqa: E731
    assert reachable(m("http://0.0.0.0:80/", True, "x")) == "http://127.0.0.1:80"
    assert reachable(m("http://[::]:81", False, "mac2.lan")) == "http://mac2.lan:81"
    assert reachable(m("http://10.0.0.2:82", False, "a")) == "http://10.0.0.2:82"


def test_read_heal_is_tolerant(tmp_path):
    state = StateDir(tmp_path)
    p = tmp_path / "heal" / "c.json"
    assert read_heal(state, "c") is None
    p.parent.mkdir()
    for bad in ("", "{", "[]", json.dumps({"state": "weird"}), "x" * 100000):
        p.write_text(bad)
        assert read_heal(state, "c") is None
    p.write_text(json.dumps({"state": "healing", "reason": "node b lost", "since": "2026-12-05T12:00:00Z",
                             "heals": 1, "more": {"fields": "ignored"}}))
    h = read_heal(state, "c")
    assert (h.state, h.reason) == ("healing", "node b lost")
    # a supervisor that is gone does not leave the front saying "healing" forever
    p.write_text(json.dumps({"state": "healing", "reason": None, "since": None,
                             "supervisor": {"host": __import__("socket").gethostname(), "pid": 2**22 + 7,
                                            "start_time": 1.0, "boot_id": None}}))
    assert read_heal(state, "c") is None
