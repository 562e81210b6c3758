"""A marker as a look shows it (protocol/runtimefiles.py, ``MarkerView.read``): the one tolerant reader of what a
node sent, where the launcher's ``parse_marker`` is strict. A field of the wrong type or out of range reads as
None, never as an error; texts are cut short; a garbled file never crashes status, quiescence or the supervisor."""

from __future__ import annotations

import math

import pytest

from clusterctl.protocol.runtimefiles import MarkerView, parse_marker

FIELDS = ("rank", "state", "endpoint", "error", "reason", "cancel_epoch", "batch", "queued", "tokens_out", "rss_bytes",
          "step_s", "idle_share", "ladder", "prompt_cache")


@pytest.mark.parametrize("doc", [None, "serving", 3, [], {}, {"type": "something else", "x": 1}])
def test_what_is_no_marker_reads_as_an_empty_one(doc):
    mk = MarkerView.read(doc)
    assert all(getattr(mk, f) is None for f in FIELDS) and mk.active_requests == []


@pytest.mark.parametrize("field, value, want", [
    ("state", "serving", "serving"), ("state", 3, None), ("state", "x" * 600, "x" * 500),
    ("error", ["no"], None), ("reason", "peer_lost", "peer_lost"), ("endpoint", None, None),
    ("cancel_epoch", 7, 7), ("cancel_epoch", -1, -1), ("cancel_epoch", True, None), ("cancel_epoch", 7.0, None),
    ("batch", 3, 3), ("batch", -1, None), ("batch", False, None), ("rss_bytes", "9", None), ("tokens_out", 2**40, 2**40),
    ("step_s", 0.25, 0.25), ("step_s", 2, 2.0), ("step_s", -0.1, None), ("idle_share", 1e9, None),
    ("idle_share", math.nan, None), ("idle_share", math.inf, None), ("step_s", True, None),
    ("ladder", "probe", "probe"), ("ladder", "y" * 300, "y" * 200), ("ladder", 1, None),
    ("prompt_cache", [1, 2, 3], [1, 2, 3]), ("prompt_cache", [1, 2], None), ("prompt_cache", [True, 1, 2], None),
    ("prompt_cache", [1.0, 2, 3], None), ("prompt_cache", [-1, -2, -3], [-1, -2, -3]), ("prompt_cache", "123", None),
    ("rank", 2, 2), ("rank", "2", None),
])
def test_a_field_of_the_wrong_type_or_out_of_range_reads_as_none(field, value, want):
    got = getattr(MarkerView.read({field: value, "state": "ready"} if field != "state" else {field: value}), field)
    assert got == want and type(got) is type(want)


def test_the_request_ids_are_strings_cut_short_and_at_most_a_thousand():
    assert MarkerView.read({"active_requests": ["a", 1, None]}).active_requests == ["a", "1", "None"]
    assert MarkerView.read({"active_requests": "r1"}).active_requests == []
    many = MarkerView.read({"active_requests": ["z" * 300] * 1200}).active_requests
    assert len(many) == 1000 and all(x == "z" * 200 for x in many)


def test_the_strict_reader_refuses_what_the_tolerant_one_reads():
    doc = {"state": "serving", "active_requests": ["r1"], "batch": -4}
    assert parse_marker(doc) is None
    assert MarkerView.read(doc).state == "serving" and MarkerView.read(doc).batch is None
