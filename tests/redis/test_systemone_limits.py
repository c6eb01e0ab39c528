"""System One calls at the gateway's limits, against real processes: a gateway of this module's own on the shared
stack's server (tests/redis/gateways.py), in front of an in-process worker that serves the model ``solo`` from shard 1
of namespace ``limits`` while the gateway sends to shard 0, so that every call is routed (a live worker serves its
model) and stays queued for as long as the test wants. Each test is a defect of round five's adversarial pass
(docs/RELIABILITY.md, "Hostile callers"): compressed bodies that inflate outside the body budget, identical calls
waiting for a request a full queue never took, an alias that shadows a served name, a call whose model's last worker
leaves while it waits.
"""

from __future__ import annotations

import gzip
import json
import threading
import time

import httpx
import pytest
import redis
from backports import zstd

from gateways import TOKENS, GatewayProcess
from producer.client import Client
from producer.wire.keys import Keys
from test_gateway_hostile import rss_mb

pytestmark = pytest.mark.redis
NAMESPACE, MODEL = "limits", "solo"
KEYS = [{"name": "acme", "token": TOKENS["acme"], "namespace": NAMESPACE, "max_inflight": 64,
         "model_namespaces": [NAMESPACE, "lonely"]}]
AUTH = {"Authorization": f"Bearer {TOKENS['acme']}"}
BUDGET = 32 << 20  # bodies held at once over every caller; the body limit stays the default 8 MiB
LIMITS = dict(model_namespaces=NAMESPACE, max_body_bytes_in_flight=BUDGET, max_unfinished=50, wait_s=8)
NOUL = {"q": {"type": "noul", "instructions": "Is a refund asked for?"}}


@pytest.fixture(scope="module")
def started():
    made: dict = {}
    yield made
    for gateway, worker in made.values():
        gateway.stop()
        worker.stop()


@pytest.fixture
def limited(server_binary, stack, started, loaded, tmp_path_factory) -> GatewayProcess:
    """This server's gateway with this module's limits, and the worker that serves ``solo`` but reads shard 1."""
    from inprocess import InProcessWorker

    if server_binary.label not in started:
        worker = InProcessWorker(loaded("repo"), stack.server.url, namespace=NAMESPACE, shard=1,
                                 served_model_name=MODEL).start()
        log = tmp_path_factory.mktemp("limits") / "gateway.log"
        started[server_binary.label] = (GatewayProcess(stack.server.url, log, KEYS, **LIMITS).wait_up(), worker)
    gateway, _ = started[server_binary.label]
    connection = redis.Redis.from_url(stack.server.url)
    for key in connection.scan_iter(f"{NAMESPACE}:*"):  # what an earlier test left queued or mapped
        if b":workers" not in key and b"{s1}" not in key:  # the worker's own streams stay
            connection.delete(key)
    connection.close()
    return gateway


def call(state: str, model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "state": state, "questions": NOUL}).encode()


def flood(gateway: GatewayProcess, bodies: list[tuple[str, bytes]], peak: list[float]) -> list[httpx.Response]:
    """Every body at once (``(encoding, bytes)``), each on its own connection; the gateway's resident memory's
    peak is kept in ``peak`` while they run."""
    answers: list = [None] * len(bodies)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(gateway.process.pid))
            time.sleep(0.02)

    def send(index: int, encoding: str, body: bytes) -> None:
        answers[index] = httpx.post(gateway.url + "/v1/systemone", content=body, timeout=60, headers={
            **AUTH, "Content-Type": "application/json", "Content-Encoding": encoding})

    watcher = threading.Thread(target=watch)
    watcher.start()
    callers = [threading.Thread(target=send, args=(i, *body)) for i, body in enumerate(bodies)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(120)
    done.set()
    watcher.join()
    return answers


def test_compressed_bodies_count_inflated_against_the_body_budget(limited):
    """Forty small compressed calls (zstd and gzip, about 10 KB each) that inflate to 7.5 MB each, held waiting: the
    budget (32 MiB) takes four at a time and refuses the rest 503 busy, and the gateway's memory stays near it.
    Before, the declared length (10 KB) was charged: every call inflated outside the budget, about three copies
    each lived for the whole wait, and the gateway grew by about a gigabyte."""
    before = rss_mb(limited.process.pid)
    size = 7_500_000
    bodies = []
    for n in range(40):
        raw = call(f"call {n}: " + "refund " * (size // 7))
        bodies.append(("zstd", zstd.compress(raw)) if n % 2 else ("gzip", gzip.compress(raw)))
    assert max(len(body) for _, body in bodies) < 40_000
    peak = [before]
    answers = flood(limited, bodies, peak)
    print(f"gateway memory: {before:.0f} MB, peak {peak[0]:.0f} MB")
    statuses = sorted(answer.status_code for answer in answers)
    busy = [a for a in answers if a.status_code == 503]
    assert set(statuses) <= {503, 504}, statuses
    assert len(busy) >= 40 - BUDGET // size, statuses
    assert all(a.json()["detail"]["error_type"] == "busy" and a.headers["retry-after"] == "1" for a in busy)
    # Four bodies of 7.5 MB held once each, and what inflating and parsing one needs: far from 40 x 3 x 7.5 MB.
    assert peak[0] - before < 250, f"the gateway grew by {peak[0] - before:.0f} MB (from {before:.0f} MB)"


def test_identical_calls_against_a_full_queue_are_all_refused_at_once(limited, stack):
    """The lane full (50 entries, the limit): of twenty identical calls, the first claims the call and is refused
    429; the others, which found its claim, get the same 429 at once. Before, they waited --wait-s (8 s) for a
    request no stream held, then 504."""
    with Client(stack.server.url, namespace=NAMESPACE, max_unfinished=0) as own:
        own.submit_many([{"state": f"filler {n}", "questions": NOUL} for n in range(50)])
    body = call("The same call, twenty times, against a full lane.")
    answers: list = [None] * 20

    def send(index: int) -> None:
        answers[index] = httpx.post(limited.url + "/v1/systemone", content=body, timeout=30,
                                    headers={**AUTH, "Content-Type": "application/json"})

    started = time.monotonic()
    callers = [threading.Thread(target=send, args=(n,)) for n in range(20)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    took = time.monotonic() - started
    print(f"twenty identical calls against a full lane: answered in {took:.2f} s")
    assert [a.status_code for a in answers] == [429] * 20, [(a.status_code, a.text[:120]) for a in answers]
    assert all(a.json()["detail"]["error_type"] == "queue_full" and a.headers["retry-after"] == "1" for a in answers)
    assert took < 5, f"{took:.1f} s"
    assert redis.Redis.from_url(stack.server.url).xlen(Keys(NAMESPACE).requests) == 50  # none of them went in


def test_an_alias_never_shadows_a_served_name(limited, stack, loaded, tmp_path):
    """An alias naming a model live workers serve: refused at start (exit 2, saying which); one whose name a worker
    comes to serve later is logged once and no longer routed by, for any caller (the key that cannot reach that
    worker gets 404, never the alias's model). Before, ``--model-alias decider-b=decider-a`` started without a word
    and sent calls naming decider-b to decider-a for one key."""
    from inprocess import InProcessWorker

    refused = GatewayProcess(stack.server.url, tmp_path / "refused.log", KEYS, model_alias=f"{MODEL}=another",
                             model_namespaces=NAMESPACE)
    assert refused.process.wait(60) == 2
    assert f"{MODEL}=another (namespace {NAMESPACE} serves a model named '{MODEL}')" in (
        tmp_path / "refused.log").read_text()
    keys = [{"name": "acme", "token": TOKENS["acme"], "namespace": "lonely", "model_namespaces": [NAMESPACE]},
            {"name": "both", "token": TOKENS["globex"], "namespace": "lonely",
             "model_namespaces": [NAMESPACE, "lately"]}]
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", keys, model_alias=f"late={MODEL}",
                             wait_s=30).wait_up()
    worker = None
    try:
        listed = httpx.get(gateway.url + "/v1/models", headers=AUTH).json()["models"]
        assert {m["name"]: m["description"].startswith(f"an alias of {MODEL}") for m in listed} == {
            MODEL: False, "late": True}
        worker = InProcessWorker(loaded("repo"), stack.server.url, namespace="lately", served_model_name="late").start()
        both = {"Authorization": f"Bearer {TOKENS['globex']}", "Content-Type": "application/json"}
        answered = httpx.post(gateway.url + "/v1/systemone", content=call("Which model?", "late"), headers=both,
                              timeout=30)
        assert answered.status_code == 200 and answered.json()["model"] == "late", answered.text
        alone = httpx.post(gateway.url + "/v1/systemone", content=call("Which model?", "late"), timeout=30,
                           headers={**AUTH, "Content-Type": "application/json"})
        assert alone.status_code == 404 and alone.json()["detail"]["error_type"] == "model_not_found", alone.text
        assert [m["name"] for m in httpx.get(gateway.url + "/v1/models", headers=AUTH).json()["models"]] == [MODEL]
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()
    assert (tmp_path / "gateway.log").read_text().count("--model-alias late=solo is not used") == 1


def test_a_call_whose_models_last_worker_leaves_ends_at_once_saying_so(limited, stack, loaded):
    """A call waits (its request queued where nobody reads) when the only worker serving its model stops: it is
    answered 503 within a couple of seconds, naming the model, the request left queued; the next call is 404.
    Before, the call waited the whole --wait-s (8 s) for a 504, while the next one got 404 at once."""
    from inprocess import InProcessWorker

    worker = InProcessWorker(loaded("repo"), stack.server.url, namespace="lonely", shard=1,
                             served_model_name="lonely").start()
    answer: list = []
    caller = threading.Thread(target=lambda: answer.append(httpx.post(
        limited.url + "/v1/systemone", content=call("Anyone there?", "lonely"), timeout=30,
        headers={**AUTH, "Content-Type": "application/json"})))
    connection = redis.Redis.from_url(stack.server.url)
    caller.start()
    deadline = time.monotonic() + 10
    while not connection.xlen(Keys("lonely").requests):
        assert time.monotonic() < deadline, "the call was not queued"
        time.sleep(0.02)
    worker.stop()
    left = time.monotonic()
    caller.join(30)
    [reply] = answer
    print(f"the call waiting for a model whose last worker left: answered {time.monotonic() - left:.2f} s after")
    assert reply.status_code == 503 and time.monotonic() - left < 4, (reply.status_code, reply.text)
    assert "no live worker serves the model 'lonely' any more" in reply.json()["detail"]["message"]
    assert reply.headers["retry-after"] == "1"
    assert connection.xlen(Keys("lonely").requests) == 1  # still queued
    after = httpx.post(limited.url + "/v1/systemone", content=call("And now?", "lonely"), timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})
    assert after.status_code == 404
    connection.delete(Keys("lonely").requests)
    connection.close()
