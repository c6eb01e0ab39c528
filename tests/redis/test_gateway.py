"""The gateway's routes and statuses against real processes: a server, a CPU worker (tiny checkpoint) and
``python -m producer.gateway`` (tests/redis/gateways.py). Each test keeps to ids of its own."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import redis

from gateways import request
from producer.client.plans import prepare
from producer.wire.keys import HIGH, Keys

ROOT = Path(__file__).resolve().parents[2]
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTHER_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def publish(stack, namespace: str, request_id: str) -> None:
    """What a worker does for a request (``request(request_id)``): one entry on its result stream, with its digest."""
    body = json.dumps({"id": request_id, "status": "ok", "answers": {"refund": {"type": "noul", "noul": 0.5}},
                       "digest": prepare(request(request_id)).digest})
    redis.Redis.from_url(stack.server.url).xadd(Keys(namespace).result(request_id), {"body": body})


def lines(reply: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in reply.text.splitlines() if line]


def test_decide_answers_the_queues_result_with_metadata_and_trace_context(stack):
    with stack.gateway.client("acme") as http:
        before = stack.gateway.metric("dq_gateway_requests_total", route="decide", lane="high", status="200")
        reply = http.post("/v1/decide", json=request("gw-decide-1", priority="high", metadata={"tenant": "acme"}),
                          headers={"traceparent": TRACE})
        assert reply.status_code == 200, reply.text
        result = reply.json()
        assert result["id"] == "gw-decide-1" and result["status"] == "ok" and 0 <= result["answers"]["refund"][
            "noul"] <= 1
        assert result["metadata"] == {"tenant": "acme"} and result["traceparent"] == TRACE  # the header's
        stored = redis.Redis.from_url(stack.server.url).xrange(Keys().result("gw-decide-1"))
        assert len(stored) == 1 and json.loads(stored[0][1][b"body"]) == result  # the queue's own result, as is
        # A traceparent in the body wins over the header's; an invalid header is ignored, as W3C says.
        reply = http.post("/v1/decide", json=request("gw-decide-2", traceparent=OTHER_TRACE),
                          headers={"traceparent": TRACE})
        assert reply.json()["traceparent"] == OTHER_TRACE
        assert "traceparent" not in http.post("/v1/decide", json=request("gw-decide-3"),
                                              headers={"traceparent": "garbage"}).json()
    assert stack.gateway.metric("dq_gateway_requests_total", route="decide", lane="high", status="200") == before + 1


def test_invalid_input_is_422_with_the_code_and_the_field_and_nothing_is_queued(stack):
    queued = stack.gateway.metric("dq_gateway_queued_requests_total")
    with stack.gateway.client("acme") as http:
        cases = [  # (body, code, field)
            ({"state": "x", "questions": {"tone": {"type": "choice"}}}, "invalid_request", "questions.tone.criteria"),
            ({"state": "x", "questions": {}}, "invalid_request", "questions"),
            ({"state": "x", "questions": {"q": {"type": "noul"}}, "colour": "red"}, "invalid_request", "colour"),
            (request("bad id!"), "invalid_request", "id"),
            (request("1700000000000-0"), "invalid_request", "id"),  # a stream entry id's shape: reserved
            (request(priority="urgent"), "invalid_request", "priority"),
            (request(traceparent="00-zz"), "invalid_request", "traceparent"),
            (request(metadata={"x": "y" * 5000}), "invalid_request", "metadata"),
            (request(reply_to="dq:v1:reply:mine"), "invalid_request", "reply_to"),
            ([1, 2], "invalid_json", "body"),
        ]
        for body, code, field in cases:
            reply = http.post("/v1/decide", json=body)
            assert reply.status_code == 422, (body, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == (code, field), (body, error)
            assert error["message"].startswith(field) or code == "invalid_json" or field == "reply_to"
        reply = http.post("/v1/decide", content=b'{"state": "x", "questions": ', headers={"content-type":
                                                                                          "application/json"})
        assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_json"
        # In a batch, the field says which request.
        reply = http.post("/v1/decide/batch", json={"requests": [request("gw-422-ok"), request("gw-422-bad",
                                                                                                  priority="x")]})
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "requests.1.priority"
        reply = http.post("/v1/decide/batch", json={"requests": [request("gw-twice"), request("gw-twice")]})
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "requests.1.id"
        for timeout in ("0", "-1", "nan", "inf", "soon"):
            reply = http.post("/v1/decide", params={"timeout": timeout}, json=request("gw-422-t"))
            assert reply.status_code == 422 and reply.json()["error"]["field"] == "timeout", timeout
    assert stack.gateway.metric("dq_gateway_queued_requests_total") == queued  # refused before sending


def test_a_reused_id_with_another_request_is_409_id_conflict_never_the_other_requests_answer(stack):
    """An id names one result: the same request again gets it (a retry), a different request under the id gets
    id_conflict naming both digests (409 from decide, a line in a batch), as the Python client's decide answers;
    the stored result stays and GET by id still returns it."""
    with stack.gateway.client("acme") as http:
        first = http.post("/v1/decide", json=request("gw-reuse-1", state="I was charged twice, refund me."))
        assert first.status_code == 200 and first.json()["status"] == "ok", first.text
        stored = first.json()["digest"]
        again = http.post("/v1/decide", json=request("gw-reuse-1", state="I was charged twice, refund me."))
        assert again.status_code == 200 and again.json()["digest"] == stored  # a retry: the stored result
        other = http.post("/v1/decide", json=request("gw-reuse-1", state="Another ticket: all good, thanks!"))
        assert other.status_code == 409, other.text
        body = other.json()
        assert body["id"] == "gw-reuse-1" and body["status"] == "error" and body["error"]["code"] == "id_conflict"
        assert stored in body["error"]["message"] and body["digest"] != stored and "answers" not in body
        batch = lines(http.post("/v1/decide/batch", json={"requests": [
            request("gw-reuse-1", state="Yet another ticket."), request("gw-reuse-2")]}))
        by_id = {line["id"]: line for line in batch}
        assert by_id["gw-reuse-1"]["error"]["code"] == "id_conflict" and "answers" not in by_id["gw-reuse-1"]
        assert by_id["gw-reuse-2"]["status"] == "ok"
        assert http.get("/v1/results/gw-reuse-1").json()["digest"] == stored  # the stored result stays


def test_no_result_in_time_is_504_with_the_id_and_the_result_is_fetchable_later(stack):
    """Namespace globex has no worker: nothing answers in time, and the 504 says so. The result, published later (as
    a worker would), is read by the id the 504 gave, by a GET already waiting for it (a worker killed mid-request:
    test_gateway_faults)."""
    with stack.gateway.client("globex") as http:
        started = time.monotonic()
        reply = http.post("/v1/decide", params={"timeout": 0.5}, json=request("gw-late-1"))
        assert reply.status_code == 504 and 0.5 <= time.monotonic() - started < 3
        digest = prepare(request("gw-late-1")).digest
        assert reply.json()["id"] == "gw-late-1" and reply.json()["error"]["code"] == "timeout"
        assert reply.json()["error"]["message"].startswith(  # why: no worker of globex is alive
            "no result in time (0.5 s); no live worker in namespace 'globex' (no heartbeat in the last 30 s")
        assert reply.json()["digest"] == digest and reply.headers["location"] == f"/v1/results/gw-late-1?digest={digest}"
        assert http.get("/v1/results/gw-late-1").status_code == 404  # still queued: no result yet
        threading.Timer(0.5, publish, (stack, "globex", "gw-late-1")).start()
        later = http.get(reply.headers["location"], params={"wait": 10})
        assert later.status_code == 200 and later.json()["id"] == "gw-late-1" and later.json()["status"] == "ok"


def test_a_batch_streams_one_line_per_request_each_id_exactly_once(stack):
    ids = [f"gw-batch-{i}" for i in range(20)]
    with stack.gateway.client("acme") as http:
        reply = http.post("/v1/decide/batch", json={"requests": [request(r) for r in ids[:10]] + [
            request(r, priority="high") for r in ids[10:]]})
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-ndjson"
        got = lines(reply)
        assert sorted(line["id"] for line in got) == sorted(ids) and all(line["status"] == "ok" for line in got)
        # Generated ids: each request still gets its one line.
        got = lines(http.post("/v1/decide/batch", json={"requests": [request(), request()]}))
        assert len({line["id"] for line in got}) == 2 and all(line["status"] == "ok" for line in got)


def test_batch_lines_come_as_results_land_and_missing_ones_time_out_once(stack):
    """In namespace globex (no worker) one result is there already (published as a worker would): its line comes at
    once, the two missing ones at the deadline, as timeouts, each id once."""
    publish(stack, "globex", "gw-there")
    with stack.gateway.client("globex") as http:
        started, arrivals = time.monotonic(), []
        batch = {"requests": [request("gw-missing-1"), request("gw-there"), request("gw-missing-2")]}
        with http.stream("POST", "/v1/decide/batch", params={"timeout": 2}, json=batch) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                arrivals.append((time.monotonic() - started, json.loads(line)))
    assert [a[1]["id"] for a in arrivals][0] == "gw-there" and arrivals[0][0] < 1.5
    assert sorted(a[1]["id"] for a in arrivals) == ["gw-missing-1", "gw-missing-2", "gw-there"]
    assert all(a[1]["error"]["code"] == "timeout" and a[0] >= 2 for a in arrivals[1:])


def test_fire_and_forget_answers_the_ids_then_results_are_read_by_id(stack):
    with stack.gateway.client("acme") as http:
        one = http.post("/v1/requests", json=request("gw-ff-1"))
        assert one.status_code == 202 and one.json() == {"ids": ["gw-ff-1"], "digests": [prepare(request(
            "gw-ff-1")).digest]}
        many = http.post("/v1/requests", json={"requests": [request("gw-ff-2"), request()]})
        assert many.status_code == 202
        ids = many.json()["ids"]
        assert ids[0] == "gw-ff-2" and re.fullmatch(r"[0-9a-f]{32}", ids[1])
        for request_id in ["gw-ff-1", *ids]:
            reply = http.get(f"/v1/results/{request_id}", params={"wait": 30})
            assert reply.status_code == 200 and reply.json()["id"] == request_id
        started = time.monotonic()
        assert http.get("/v1/results/gw-never", params={"wait": 0.3}).status_code == 404
        assert time.monotonic() - started >= 0.3
        assert http.get("/v1/results/gw-never", params={"wait": -1}).status_code == 422


def test_a_full_lane_is_429_with_retry_after_and_the_other_lane_still_takes_requests(stack):
    """globex's high lane (no worker drains it) filled to the gateway's --max-unfinished (30)."""
    backlog = redis.Redis.from_url(stack.server.url).xlen(Keys("globex").requests_in(HIGH))
    with stack.gateway.client("globex") as http:
        for start in range(backlog, 30, 15):
            fill = [request(f"gw-full-{i}", priority="high") for i in range(start, min(30, start + 15))]
            assert http.post("/v1/requests", json={"requests": fill}).status_code == 202
        reply = http.post("/v1/requests", json={"requests": [request("gw-full-x", priority="high")]})
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "queue_full" and reply.json()["refused"] == ["gw-full-x"]
        assert http.post("/v1/decide", json=request("gw-full-y", priority="high")).status_code == 429
        assert http.post("/v1/requests", json=request("gw-full-normal")).status_code == 202


def test_health_readiness_metrics_and_the_openapi_description(stack):
    assert httpx.get(stack.gateway.url + "/health").json() == {"status": "ok"}
    # Ready: its own ability to serve, whether or not its namespaces have workers (globex and kill have none), and
    # without naming them: nothing of a tenant is there (test_gateway_hostile.py has the rest).
    for gateway in (stack.open, stack.gateway):
        ready = httpx.get(gateway.url + "/ready")
        assert ready.status_code == 200 and ready.json()["redis"] == "ok", ready.text
        assert "globex" not in ready.text and "kill" not in ready.text and "workers" not in ready.text
    text = httpx.get(stack.gateway.url + "/metrics").text
    for name in ("dq_gateway_requests_total", "dq_gateway_request_seconds_bucket", "dq_gateway_in_flight",
                 "dq_gateway_queued_requests_total"):
        assert name in text
    assert stack.gateway.metric("dq_gateway_in_flight", route="metrics") == 1  # this very call
    spec = httpx.get(stack.gateway.url + "/openapi.json").json()
    assert {"/v1/decide", "/v1/decide/batch", "/v1/requests", "/v1/results/{request_id}", "/health", "/ready",
            "/metrics"} <= set(spec["paths"])
    assert "Request" in spec["components"]["schemas"]


def test_the_readme_curl_example_works_as_written(stack):
    """The README's curl block, run by bash against the open gateway (its address put in for localhost:8080)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(curl [^`]*localhost:8080[^`]*)```", readme)
    assert block, "README has no curl example against localhost:8080"
    script = block.group(1).replace("localhost:8080", f"127.0.0.1:{stack.open.port}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    decoder, text, answers = json.JSONDecoder(), done.stdout.strip(), []
    while text:  # curl -s writes each reply without a newline after it
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].strip()
    results = [a for a in answers if "status" in a]
    assert results and all(a["status"] == "ok" for a in results), done.stdout
