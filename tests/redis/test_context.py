"""A request's metadata and W3C traceparent end to end, with a real worker on the tiny checkpoint (CPU): echoed in
its result (ok, fanned out, or error), refused with invalid_request naming the field when bad, written in the
worker's log lines about the request; and requests without them (older producers) work as before."""

import json
import time

import pytest

from producer.client import Client
from producer.wire.keys import Field

pytestmark = [pytest.mark.redis, pytest.mark.slow]
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
META = {"tenant": "acme", "correlation": ["c-1", 2, None], "nested": {"deep": True}}
QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"}}


def request(request_id: str, **extra) -> dict:
    return {"id": request_id, "state": f"Refund me ({request_id}).", "questions": QUESTIONS, **extra}


def test_metadata_and_traceparent_are_echoed_checked_and_logged(redis_server, start_worker, tiny_dir):
    worker = start_worker(tiny_dir, redis_server.url, log_format="json", log_level="DEBUG", max_prompt_tokens=220,
                          fanout_tokens=200)
    client = Client(redis_server.url)
    context = {"metadata": META, "traceparent": TRACE}
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    ids = client.submit_many([request("c-ok", **context), request("c-old"),
                              {**request("c-fan", **context), "questions": many},
                              request("c-late", deadline_ms=1, **context)])
    plain = {  # what a producer in another language may send: the Python client refuses these before sending
        "c-badq": request("c-badq", **context) | {"questions": {"q": {"type": "no-such-type"}}},
        "c-badtrace": request("c-badtrace", metadata=META, traceparent=TRACE.upper()),
        "c-bigmeta": request("c-bigmeta", traceparent=TRACE, metadata={"blob": "x" * 5000}),
    }
    for body in plain.values():
        client.redis.xadd(client.keys.requests, {Field.BODY: json.dumps(body)})
    results = client.wait_many([*ids, *plain], timeout=120)

    for request_id in ("c-ok", "c-fan"):
        assert results[request_id].ok and (results[request_id].metadata, results[request_id].traceparent) == \
            (META, TRACE), request_id
    assert results["c-fan"].usage.parts > 1  # merged from parts taken from the part stream
    old = json.loads(client.redis.xrange(client.keys.result("c-old"))[0][1][Field.BODY.encode()])
    assert old["status"] == "ok" and "metadata" not in old and "traceparent" not in old
    # Error results echo whatever was valid in the request.
    for request_id, code in (("c-late", "deadline_exceeded"), ("c-badq", "invalid_request")):
        assert results[request_id].error.code == code
        assert (results[request_id].metadata, results[request_id].traceparent) == (META, TRACE), request_id
    bad_trace, big_meta = results["c-badtrace"], results["c-bigmeta"]
    assert bad_trace.error.code == "invalid_request" and bad_trace.error.message.startswith("traceparent: ")
    assert (bad_trace.metadata, bad_trace.traceparent) == (META, None)
    assert big_meta.error.code == "invalid_request" and big_meta.error.message.startswith("metadata: ")
    assert "over the 4096-byte limit" in big_meta.error.message and big_meta.metadata is None
    assert big_meta.traceparent == TRACE

    expected = {"c-ok": TRACE, "c-old": None, "c-fan": TRACE, "c-late": TRACE, "c-badq": TRACE,
                "c-badtrace": None, "c-bigmeta": TRACE}
    deadline = time.monotonic() + 10  # a result is readable before the worker logs its publication
    while True:
        lines = [json.loads(line) for line in worker.log.read_text().splitlines() if line.startswith("{")]
        about = {line["request_id"]: line.get("traceparent") for line in lines if line["msg"].startswith("published ")}
        if about == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert about == expected
    fanned = [line for line in lines if line["msg"].startswith("fanned c-fan out")]
    assert len(fanned) == 1 and fanned[0]["traceparent"] == TRACE
