"""The HTTP edge's rules (protocol/httpedge.py), which rank 0 and the front both apply: keys by tenant, CORS,
the error document, the body bound, the outcome labels."""

from __future__ import annotations

import pytest

from clusterctl.protocol.httpedge import (MAX_BODY, Access, Cors, ErrorType, FrontOutcome, Keys, RankOutcome,
                                          body_too_large, error_document, error_type, front_outcome, is_too_large,
                                          rank_outcome)

A, B = "a" * 16, "b" * 16


def test_keys_name_the_tenant_and_refuse_the_rest():
    keys = Keys.of({"default": A, "team": B})
    assert keys.tenant(f"Bearer {A}") == "default" and keys.tenant(f"Bearer  {B} ") == "team"
    for bad in (None, "", A, f"Basic {A}", "Bearer nope", f"Bearer {A}x"):
        assert keys.tenant(bad) is None and not keys.authorized(bad)
    assert Keys().tenant(None) == "" and Keys().open and Access().authorized(None)


def test_cors_any_origin_is_star_with_or_without_an_origin_header():
    """The one rule of rank 0 and the front: allowed origins ``*`` answer ``*`` even to a request without Origin
    (the front said nothing there before the rule was shared)."""
    star = Cors(("*",))
    assert star.headers(None) == star.headers("https://x.example") == {"Access-Control-Allow-Origin": "*"}
    assert star.preflight_headers(None)["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
    listed = Cors(("https://app.example",))
    assert listed.headers("https://app.example") == {"Access-Control-Allow-Origin": "https://app.example",
                                                     "Vary": "Origin"}
    assert listed.headers(None) == listed.headers("https://evil.example") == {}
    assert listed.preflight_headers("https://evil.example") == {} and listed.enabled
    assert not Cors().enabled and Cors().headers("https://app.example") == {}


def test_the_error_document_and_its_type():
    assert error_document("no", type=error_type(404), code="x") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": "x"}}
    assert error_type(503) is ErrorType.SERVER and error_document("m", type=ErrorType.RATE_LIMIT, param="p")[
        "error"] == {"message": "m", "type": "rate_limit_error", "param": "p", "code": None}


def test_the_body_bound():
    assert not is_too_large(MAX_BODY) and is_too_large(MAX_BODY + 1) and MAX_BODY == 4 << 20
    assert body_too_large() == f"request body over {MAX_BODY} bytes"
    assert body_too_large(10) == "request body over 10 bytes"


@pytest.mark.parametrize("status,rank,front", [(200, "ok", "ok"), (204, "ok", "ok"), (401, "4xx", "client_error"),
                                               (429, "429", "client_error"), (500, "5xx", "server_error"),
                                               (503, "5xx", "server_error")])
def test_outcome_labels(status, rank, front):
    assert rank_outcome(status) == rank and front_outcome(status) == front
    assert str(rank_outcome(status)) == rank  # the metric's label is the value, not the enum's name
    assert [str(o) for o in RankOutcome] == ["ok", "cancelled", "4xx", "429", "5xx"]
    assert {str(o) for o in FrontOutcome} == {"ok", "client_error", "server_error", "unavailable", "upstream_lost",
                                              "client_gone"}
