"""Cancel and status over HTTP, and the cancel a caller's hang-up makes (producer/gateway/cancels.py), against real
processes (tests/redis/gateways.py): namespace globex has no worker, so its requests stay queued until cancelled."""

from __future__ import annotations

import time

import httpx
import pytest

from gateways import request
from test_gateway import publish


def until(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def state(http: httpx.Client, request_id: str) -> str:
    return http.get(f"/v1/requests/{request_id}").json()["state"]


def hang_up(http: httpx.Client, path: str, body: dict, **params: str) -> None:
    """Call, and leave before the answer (the client's read times out: it closes the connection)."""
    with pytest.raises(httpx.ReadTimeout):
        http.post(path, json=body, params={"timeout": 30, **params})


def test_a_caller_that_hangs_up_on_decide_cancels_its_request_unless_it_keeps_it(stack):
    gateway = stack.gateway
    before = gateway.metric("dq_gateway_cancels_total", reason="hang_up", state="cancelled")
    with gateway.client("globex", timeout=0.5) as http:
        hang_up(http, "/v1/decide", request("gw-hang-1"))
        hang_up(http, "/v1/decide", request("gw-hang-kept"), hang_up="keep")  # this call keeps it
    with gateway.client("keeper", timeout=0.5) as http:
        hang_up(http, "/v1/decide", request("gw-hang-key-kept"))  # this key keeps them
    with gateway.client("globex") as http:
        until(lambda: state(http, "gw-hang-1") == "cancelled", what="the hang-up's cancel")
        assert state(http, "gw-hang-kept") == "queued" and state(http, "gw-hang-key-kept") == "queued"
        assert http.post("/v1/decide", json=request(), params={"hang_up": "never"}).status_code == 422
    assert gateway.metric("dq_gateway_cancels_total", reason="hang_up", state="cancelled") == before + 1
    assert gateway.metric("dq_gateway_cancels_total", reason="hang_up", state="keep") >= 2


def test_a_caller_that_hangs_up_on_a_batch_cancels_only_the_requests_without_a_line(stack):
    publish(stack, "globex", "gw-batch-answered")  # answered at once: its line comes first
    with stack.gateway.client("globex") as http:
        body = {"requests": [request("gw-batch-answered"), request("gw-batch-0"), request("gw-batch-1")]}
        with http.stream("POST", "/v1/decide/batch", json=body, params={"timeout": 30}) as reply:
            first = next(reply.iter_lines())
            assert '"gw-batch-answered"' in first
        # the caller left after one line
        until(lambda: state(http, "gw-batch-0") == state(http, "gw-batch-1") == "cancelled", what="the cancels")
        assert state(http, "gw-batch-answered") == "answered"


def test_delete_and_get_cancel_and_say_where_requests_are_in_the_callers_namespace_only(stack):
    with stack.gateway.client("globex") as globex, stack.gateway.client("acme") as acme:
        assert globex.post("/v1/requests", json={"requests": [request("gw-del-0"), request("gw-del-1")]}).status_code \
            == 202
        seen = globex.get("/v1/requests", params={"id": ["gw-del-0", "gw-del-1", "gw-del-none"]})
        seen = seen.json()["requests"]
        assert [s["state"] for s in seen] == ["queued", "queued", "unknown"] and seen[1]["ahead"] >= 1
        assert globex.get("/v1/requests/gw-del-none").status_code == 404
        # Another tenant's key reaches only its own namespace: it finds nothing there, and cancels nothing here.
        other = acme.delete("/v1/requests/gw-del-0")
        assert other.status_code == 404 and other.json()["state"] == "unknown"
        assert state(globex, "gw-del-0") == "queued"
        mine = globex.delete("/v1/requests/gw-del-0")
        assert mine.status_code == 200 and mine.json() == {"id": "gw-del-0", "state": "cancelled"}
        assert state(globex, "gw-del-0") == "cancelled"
        both = globex.delete("/v1/requests", params={"id": ["gw-del-0", "gw-del-1"]}).json()["requests"]
        assert [c["state"] for c in both] == ["cancelled", "cancelled"]
        # An answer per id asked, in order, an id asked twice answered twice (it gave two answers for three ids).
        asked = ["gw-del-1", "gw-del-none", "gw-del-1"]
        for method in (globex.get, globex.delete):
            answers = method("/v1/requests", params={"id": asked}).json()["requests"]
            assert [(a["id"], a["state"]) for a in answers] == [("gw-del-1", "cancelled"), ("gw-del-none", "unknown"),
                                                                ("gw-del-1", "cancelled")], answers
        assert globex.delete("/v1/requests/bad%20id").status_code == 422
        # Answered: too late, 409, and it says how.
        done = acme.post("/v1/decide", json=request("gw-del-done"))
        assert done.status_code == 200
        until(lambda: acme.get("/v1/requests/gw-del-done").json().get("status") == "ok", what="its record")
        late = acme.delete("/v1/requests/gw-del-done")
        assert late.status_code == 409 and late.json() == {"id": "gw-del-done", "state": "too_late", "status": "ok"}
    assert stack.gateway.metric("dq_gateway_cancels_total", reason="delete", state="cancelled") >= 3
