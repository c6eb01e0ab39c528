"""Any System One client works unchanged: the official typesafe-sdk (sync and async), curl and Node against the
gateway's POST /v1/systemone and GET /v1/models, in front of two real CPU workers serving two different tiny
checkpoints under two names (tests/redis/systemones.py). Answers equal the queue's own for the same request and
transformers' pipeline("decision") within 1e-4; every status reaches the SDK as its exception class; a retried call
is answered once and computed once (the worker's own counters say so)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import shutil
import subprocess
import threading

import httpx
import httpx2
import pytest
import redis
import typesafe_sdk as ts
from backports import zstd
from typesafe_sdk import AsyncTypeSafeClient, Choice, Image, Noul, RetryPolicy, Score, TypeSafeClient

from producer.client import Client
from producer.gateway.systemone.retries import call_of
from producer.wire import library
from producer.wire.digest import digest
from producer.wire.keys import Keys
from producer.wire.result import Result
from producer.wire.schema import Request
from systemones import BOTH, MAX_BODY, OPEN_WAIT_S, TOKENS, start, wait_for

QUESTIONS = {"billing": Noul(instructions="Is this about billing?"),
             "spam": Noul(criteria={"true": "Unsolicited advertising", "false": None}),
             "tone": Choice(instructions="What is the tone?", criteria={"calm": None, "angry": "An upset message"}),
             "urgency": Score(instructions="How urgent?", criteria=["Can wait", "This week", {"level": "Today"}])}
STATES = ["I was charged twice, please refund me.", {"message": "Refund me", "account": {"plan": "pro"}},
          ["first message", {"role": "agent", "text": "We are sorry."}]]
NO_RETRY = RetryPolicy(max_retries=0)


@pytest.fixture(scope="module")
def stacks():
    started: dict = {}
    yield started
    for stack in started.values():
        stack.stop()


@pytest.fixture
def stack(server_binary, stacks, checkpoints, tmp_path_factory):
    from conftest import WorkerProcess

    if server_binary.label not in stacks:
        stacks[server_binary.label] = start(WorkerProcess, checkpoints, tmp_path_factory.mktemp("systemone"))
    return stacks[server_binary.label]


@pytest.fixture(scope="module")
def pipelines(checkpoints):
    """transformers' own pipeline("decision") on each served checkpoint."""
    from transformers import pipeline

    return {"decider-a": pipeline("decision", model=str(checkpoints["repo"])),
            "decider-b": pipeline("decision", model=str(checkpoints["readout"]))}


def sdk(stack, key: str = "acme", **options) -> TypeSafeClient:
    return TypeSafeClient(api_key=TOKENS.get(key, key), base_url=stack.gateway.url, timeout=30, **options)


def queue(stack, model: str) -> Client:
    """The project's own client, routed by model as the gateway routes."""
    return Client(stack.server.url, model=model, model_namespaces=BOTH)


def wired(response) -> dict:
    """The call's JSON as the SDK put it on the wire (decompressed; a multipart body's request part)."""
    sent = response.raw_http_response.request
    body = sent.content
    if sent.headers.get("content-encoding") == "zstd":
        body = zstd.decompress(body)
    if sent.headers["content-type"].startswith("multipart/form-data"):
        boundary = sent.headers["content-type"].split("boundary=")[1].encode()
        first = body.split(b"--" + boundary)[1]  # the SDK sends the request part first
        body = first.split(b"\r\n\r\n", 1)[1][:-2]
    return json.loads(body)


def request_of(call: dict, assets: dict | None = None) -> Request:
    """The queue's request for a call's JSON (``assets``: in place of the call's)."""
    return Request.model_validate({"state": call["state"], "questions": call["questions"],
                                   **({"assets": assets} if assets else {})})


def close(got: dict, expected: dict, tolerance: float) -> None:
    """An answer (the SDK's, dumped) against one of the queue's or transformers' (string keys for score levels)."""
    assert got["type"] == expected["type"]
    for name in ("noul", "score", "confidence"):
        if name in expected:
            assert got[name] == pytest.approx(expected[name], abs=tolerance), name
    if "choice" in expected:
        assert got["choice"] == expected["choice"]
    if "probabilities" in expected:
        assert {str(k): v for k, v in got["probabilities"].items()} == pytest.approx(expected["probabilities"],
                                                                                      abs=tolerance)
    if "legend" in expected:
        assert {str(k): v for k, v in got["legend"].items()} == expected["legend"]


def worker_counts(stack, namespace: str) -> tuple[float, float]:
    """(entries taken, prompt tokens through the model) of a namespace's worker, from its metrics."""
    worker = stack.workers[namespace]
    return worker.metric("dq_entries_read_total"), worker.metric("dq_tokens_total")


def test_answers_equal_the_queues_own_and_transformers(stack, pipelines):
    """Every question type, the state as text, an object and an array, on both models: through the SDK, through
    the project's client routed by the same model name, and through transformers' pipeline."""
    with sdk(stack) as client:
        for model, namespace in (("decider-a", "alpha"), ("decider-b", "beta")):
            with queue(stack, model) as own:
                for state in STATES:
                    response = client.system_one(state, QUESTIONS, model=model)
                    assert response.model == model and response.usage.output_tokens == len(QUESTIONS)
                    request = request_of(wired(response))
                    result = own.decide(request, timeout=60).raise_for_error()
                    assert result.model == model and own.keys.namespace == namespace  # a result says who answered
                    assert response.usage.input_tokens == result.usage.tokens
                    expected = pipelines[model](request.template_input())
                    for name, answer in response.answers.items():
                        close(answer.model_dump(), result.answers[name], 1e-6)
                        close(answer.model_dump(), expected[name], 1e-4)
                    assert response.request_id and len(response.request_id) == 32


def test_the_async_client_and_list_models(stack):
    async def main() -> tuple:
        async with AsyncTypeSafeClient(api_key=TOKENS["acme"], base_url=stack.gateway.url, timeout=30) as client:
            listed = await client.models.list()
            answers = await asyncio.gather(*(client.system_one(f"async call {n}", QUESTIONS, model=model)
                                             for n, model in enumerate(["decider-a", "decider-b", "b-alias"])))
            return listed, answers

    listed, answers = asyncio.run(main())
    assert [a.model for a in answers] == ["decider-a", "decider-b", "decider-b"]
    assert all(set(a.answers) == set(QUESTIONS) for a in answers)
    assert {m.name for m in listed.models} == {"decider-a", "decider-b", "b-alias", "jev-latest"}
    with sdk(stack, "alpha-only") as client:
        assert {m.name for m in client.models.list().models} == {"decider-a", "jev-latest"}


def test_routing_by_model_and_alias(stack):
    """The SDK's default model (jev-latest) through the gateway's alias, a worker's own alias, and a model served
    where the key may not send: 404 naming what it may use."""
    with sdk(stack) as client:
        assert client.system_one("Which model?", {"q": Noul(instructions="ok?")}).model == "decider-a"
        assert client.system_one("Which model?", {"q": Noul(instructions="ok?")}, model="b-alias").model == "decider-b"
    with sdk(stack, "alpha-only") as client, pytest.raises(ts.TypeSafeNotFoundError) as refused:
        client.system_one("x", {"q": Noul(instructions="ok?")}, model="decider-b")
    assert refused.value.status == 404 and "served: decider-a, jev-latest" in str(refused.value)


def png(size: tuple[int, int], noise: bool = False) -> bytes:
    from PIL import Image as Picture

    picture = Picture.effect_noise(size, 64).convert("RGB") if noise else Picture.new("RGB", size, (200, 30, 30))
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def test_images_through_the_sdk_asset_api(stack):
    """An image placed in the state, attached and named in a string, and under an alias: multipart bodies (zstd
    compressed once over 1 KiB), answered as the queue answers the same request with the image inline."""
    import base64

    small, large = png((32, 32)), png((96, 96), noise=True)
    question = {"red": Noul(instructions="Is the picture red?")}
    with sdk(stack) as client, queue(stack, "decider-a") as own:
        for data in (small, large):
            image = Image(data)
            cases = [({"photo": image, "note": "see photo"}, {}), (f"Product photo: {image}", None),
                     ("Compare IMG_A with the text.", {"IMG_A": image})]
            for state, assets in cases:
                if assets is None:
                    with client.attach_assets(image):
                        response = client.system_one(state, question)
                else:
                    response = client.system_one(state, question, assets=assets or None)
                sent = response.raw_http_response.request.headers
                assert sent["content-type"].startswith("multipart/form-data")
                assert sent.get("content-encoding") == ("zstd" if data is large else None)
                call = wired(response)
                [name] = call["assets"]
                assert name == ("IMG_A" if assets else str(image))
                inline = {name: {"type": "image", "data_base64": base64.b64encode(data).decode()}}
                expected = own.decide(request_of(call, inline), timeout=60).raise_for_error()
                close(response.answers["red"].model_dump(), expected.answers["red"], 1e-6)


def test_a_zstd_body(stack):
    state = "A long complaint about a double charge. " * 60
    with sdk(stack) as client, queue(stack, "decider-b") as own:
        response = client.system_one(state, QUESTIONS, model="decider-b")
        assert response.raw_http_response.request.headers["content-encoding"] == "zstd"
        expected = own.decide(request_of(wired(response)), timeout=60).raise_for_error()
        for name, answer in response.answers.items():
            close(answer.model_dump(), expected.answers[name], 1e-6)


def refused(call, kind=ts.TypeSafeAPIError) -> ts.TypeSafeAPIError:
    with pytest.raises(kind) as caught:
        call()
    assert type(caught.value) is kind, type(caught.value)
    assert caught.value.request_id  # every answer names a request id, refusals included
    return caught.value


def test_each_refusal_arrives_as_its_sdk_class(stack):
    noul = {"q": Noul(instructions="ok?")}
    with sdk(stack, "not-a-key-0123456789") as client:
        assert refused(lambda: client.system_one("x", noul), ts.TypeSafeAuthenticationError).status == 401
        assert refused(lambda: client.models.list(), ts.TypeSafeAuthenticationError).status == 401
    with sdk(stack, "high-only") as client:
        assert refused(lambda: client.system_one("x", noul), ts.TypeSafePermissionDeniedError).status == 403
    with sdk(stack) as client:
        error = refused(lambda: client.system_one("x", noul, model="nobody"), ts.TypeSafeNotFoundError)
        assert "served: b-alias, decider-a, decider-b, jev-latest" in str(error)
        for state, questions, where in [("x", {"q": {"type": "box", "instructions": "the dog"}}, ["questions", "q",
                                                                                                  "type"]),
                                        ("x", {"s": {"type": "score", "criteria": ["low", None]}},
                                         ["questions", "s", "criteria", 1]),
                                        (5, noul, ["state"]), ("x", {"q": {"type": "ranking"}}, ["questions", "q"])]:
            error = refused(lambda: client.system_one(state, questions), ts.TypeSafeUnprocessableEntityError)
            assert error.body["detail"][0]["loc"] == ["body", *where], error.body
        error = refused(lambda: client.system_one("x", noul, extra_body={"priority": "high"}),
                        ts.TypeSafeUnprocessableEntityError)
        assert error.body["detail"][0]["loc"] == ["body", "priority"]
        # 413 has no class of its own in the SDK: a plain body over the limit, and a small zstd one inflating past it
        assert refused(lambda: client.system_one("y" * MAX_BODY, noul)).status == 413
    with sdk(stack, compression=False) as client:
        assert refused(lambda: client.system_one("y" * MAX_BODY, noul)).status == 413


def test_429_503_and_504(stack):
    """The in-flight limit (429, Retry-After), Redis refusing writes (503) and no result in time (504): each the
    SDK's class, each retried by it by default (here once, to keep the test short)."""
    noul = {"q": Noul(instructions="ok?")}
    keys = Keys("alpha")
    connection = redis.Redis.from_url(stack.server.url)
    with sdk(stack, "one-slot", retry=NO_RETRY) as client:
        with stack.paused("alpha"):
            before = connection.xlen(keys.requests)
            holder = threading.Thread(target=lambda: client.system_one("holds the slot", noul))
            holder.start()
            wait_for(lambda: connection.xlen(keys.requests) > before, what="the first call enqueued")
            error = refused(lambda: client.system_one("over the limit", noul), ts.TypeSafeRateLimitError)
            assert error.status == 429 and error.retry_after_ms == 1000
        holder.join(60)
    connection.config_set("min-replicas-to-write", 1)  # no replica: every write refused, NOREPLICAS
    try:
        with sdk(stack, retry=NO_RETRY) as client:
            error = refused(lambda: client.system_one("no writes", noul), ts.TypeSafeInternalServerError)
            assert error.status == 503 and error.headers.get("retry-after") == "1"
    finally:
        connection.config_set("min-replicas-to-write", 0)
    with stack.paused("beta"), TypeSafeClient(api_key="any", base_url=stack.open.url, retry=NO_RETRY,
                                              timeout=OPEN_WAIT_S + 20) as client:
        error = refused(lambda: client.system_one("nobody answers", noul, model="decider-b"),
                        ts.TypeSafeInternalServerError)
        assert error.status == 504
    # It stays queued, and is answered once the worker goes on: before the next test counts that worker's work.
    wait_for(lambda: connection.exists(Keys("beta").result(error.request_id)), what="the late request answered")
    connection.close()


class SdkLog(logging.Handler):
    """Sets ``retried`` when the SDK logs that it sends a call again."""

    def __init__(self) -> None:
        super().__init__()
        self.retried = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retry 1" in record.getMessage():
            self.retried.set()


def test_a_call_whose_first_attempt_timed_out_is_answered_once_and_computed_once(stack):
    """The worker paused: the SDK's first attempt times out (1 s), it sends the same bytes again, and only then is
    the worker let go. One request is taken and computed (the worker's counters), the retry answered with it."""
    log, logger = SdkLog(), logging.getLogger("typesafe_sdk")
    logger.addHandler(log), logger.setLevel(logging.INFO)
    entries, tokens = worker_counts(stack, "alpha")
    attached = stack.gateway.metric("dq_gateway_calls_attached_total", how="retry")
    try:
        with TypeSafeClient(api_key=TOKENS["acme"], base_url=stack.gateway.url, transport=ShortFirst()) as client:
            with stack.paused("alpha"):
                answer: list = []
                caller = threading.Thread(target=lambda: answer.append(client.system_one(
                    "Charged twice; the first attempt will time out.", QUESTIONS, model="decider-a")))
                caller.start()
                assert log.retried.wait(30), "the SDK never retried"
            caller.join(60)
    finally:
        logger.removeHandler(log)
    [response] = answer
    assert response.raw_http_response.request.headers["x-typesafe-retry-count"] == "1"
    wait_for(lambda: worker_counts(stack, "alpha")[1] - tokens >= response.usage.input_tokens, what="tokens counted")
    assert worker_counts(stack, "alpha") == (entries + 1, tokens + response.usage.input_tokens)
    assert stack.gateway.metric("dq_gateway_calls_attached_total", how="retry") == attached + 1
    name = call_of("acme", "decider-a", digest(request_of(wired(response))), None)
    mapped = redis.Redis.from_url(stack.server.url).get(Keys("alpha").call(name))
    assert mapped.decode().split(" ")[0] == response.request_id


class ShortFirst(httpx2.HTTPTransport):
    """The first attempt gives up reading after one second (a real read timeout); the later ones wait 30 s."""

    calls = 0

    def handle_request(self, request):
        self.calls += 1
        request.extensions["timeout"] = {"connect": 5.0, "read": 1.0 if self.calls == 1 else 30.0, "write": 5.0,
                                         "pool": 5.0}
        return super().handle_request(request)


class DropFirst(httpx2.HTTPTransport):
    """Sends the first attempt for real and drops its answer (a read timeout, as far as the SDK knows)."""

    calls = 0

    def handle_request(self, request):
        self.calls += 1
        response = super().handle_request(request)
        if self.calls == 1:
            response.read()
            raise httpx2.ReadTimeout("the first answer is dropped", request=request)
        return response


class AsyncDropFirst(httpx2.AsyncHTTPTransport):
    calls = 0

    async def handle_async_request(self, request):
        self.calls += 1
        response = await super().handle_async_request(request)
        if self.calls == 1:
            await response.aread()
            raise httpx2.ReadTimeout("the first answer is dropped", request=request)
        return response


def test_a_retry_after_the_answer_was_lost_gets_the_stored_answer(stack):
    """The first attempt answered, its answer lost on the way: the retry (sync, then async) gets the same request's
    answer, computed once."""
    entries, tokens = worker_counts(stack, "beta")
    transport = DropFirst()
    with TypeSafeClient(api_key=TOKENS["acme"], base_url=stack.gateway.url, transport=transport) as client:
        first = client.system_one("The answer to this one gets lost.", QUESTIONS, model="decider-b")
    assert transport.calls == 2

    async def again() -> object:
        transport = AsyncDropFirst()
        async with AsyncTypeSafeClient(api_key=TOKENS["acme"], base_url=stack.gateway.url,
                                       transport=transport) as client:
            return await client.system_one("So does this one's.", QUESTIONS, model="b-alias")

    second = asyncio.run(again())
    used = first.usage.input_tokens + second.usage.input_tokens
    wait_for(lambda: worker_counts(stack, "beta")[1] - tokens >= used, what="tokens counted")
    assert worker_counts(stack, "beta") == (entries + 2, tokens + used)


def test_idempotency_keys_and_tenants(stack):
    """An Idempotency-Key maps a call to its first request, and refuses it with another request (422); identical
    calls of one tenant are one request, of two tenants two."""
    noul = {"q": Noul(instructions="Same?")}
    with sdk(stack) as client:
        one = client.system_one("keyed", noul, extra_headers={"Idempotency-Key": "order-17"})
        assert client.system_one("keyed", noul, extra_headers={"Idempotency-Key": "order-17"}).request_id == \
            one.request_id
        error = refused(lambda: client.system_one("another body", noul, extra_headers={"Idempotency-Key": "order-17"}),
                        ts.TypeSafeUnprocessableEntityError)
        assert "Idempotency-Key" in str(error)
        same = [client.system_one("identical", noul).request_id for _ in range(2)]
        # An empty key is none (RFC 9651: a field that does not parse is ignored): two calls sent with one are two
        # requests, not the second refused 422 as the first one's key reused.
        blank = [client.system_one(f"blank key {n}", noul, extra_headers={"Idempotency-Key": ""}).request_id
                 for n in range(2)]
        assert blank[0] != blank[1]
    with sdk(stack, "globex") as client:
        other = client.system_one("identical", noul).request_id
    assert same[0] == same[1] != other


def test_a_call_whose_request_is_cancelled_while_it_waits_is_answered_cancelled(stack):
    """A DELETE of the request a call waits for (its key's namespace is the model's): the call is answered 410
    ``cancelled`` in the System One shape; the same call sent after the cancel is a new ask, computed under a new
    id. Before, the waiting call sent the cancelled request again under a new id and answered 200, though the
    DELETE had said ``cancelling``."""
    connection, keys, answer = redis.Redis.from_url(stack.server.url), Keys("alpha"), []
    before = connection.xlen(keys.requests)
    entries = worker_counts(stack, "alpha")[0]
    state, auth = "This one gets cancelled under its caller.", {"Authorization": f"Bearer {TOKENS['alpha-only']}"}
    with sdk(stack, "alpha-only", retry=NO_RETRY) as client:
        with stack.paused("alpha"):
            caller = threading.Thread(target=lambda: answer.append(refused(lambda: client.system_one(
                state, QUESTIONS))))
            caller.start()
            wait_for(lambda: connection.xlen(keys.requests) > before, what="the call enqueued")
            [(_, fields)] = connection.xrevrange(keys.requests, count=1)
            cancelled = json.loads(fields[b"body"])["id"]
            deleted = httpx.delete(f"{stack.gateway.url}/v1/requests/{cancelled}", headers=auth)
            assert deleted.json()["state"] in ("cancelled", "cancelling"), deleted.text
        caller.join(60)
        [error] = answer
        assert error.status == 410 and error.request_id == cancelled
        assert error.body["detail"]["error_type"] == "cancelled", error.body
        again = client.system_one(state, QUESTIONS)
    assert again.request_id != cancelled and set(again.answers) == set(QUESTIONS)
    wait_for(lambda: worker_counts(stack, "alpha")[0] >= entries + 2, what="both entries taken")
    assert worker_counts(stack, "alpha")[0] == entries + 2  # two requests in all: the cancelled one, the new call's
    connection.close()


def test_a_base_url_ending_in_v1_is_told_to_drop_it(stack):
    """The clients append /v1/systemone to their base URL: one ending in /v1 got a bare 404 "Not Found"."""
    with TypeSafeClient(api_key=TOKENS["acme"], base_url=stack.gateway.url + "/v1", retry=NO_RETRY) as client:
        for call in (lambda: client.system_one("x", {"q": Noul(instructions="ok?")}), client.models.list):
            error = refused(call, ts.TypeSafeNotFoundError)
            assert error.status == 404 and "the base URL ends in /v1" in str(error) and "drop the /v1" in str(error)


def test_an_open_gateway_ignores_the_bearer_the_sdk_must_send(stack):
    with TypeSafeClient(api_key="anything-at-all", base_url=stack.open.url) as client:
        assert client.system_one("Open?", {"q": Noul(instructions="ok?")}, model="decider-b").model == "decider-b"


def test_curl(stack, tmp_path):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on PATH")
    call = {"model": "b-alias", "state": {"message": "curl here"}, "questions": {
        "q": {"type": "noul", "instructions": "Is it curl?"},
        "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}}
    (tmp_path / "call.json").write_text(json.dumps(call))
    (tmp_path / "call.json.zst").write_bytes(zstd.compress(json.dumps(call).encode()))
    (tmp_path / "photo.png").write_bytes(png((32, 32)))
    (tmp_path / "image.json").write_text(json.dumps({**call, "state": "A photo: PHOTO_1", "assets": {
        "PHOTO_1": {"type": "image", "part": "photo"}}}))
    base = [curl, "-sS", "-H", f"Authorization: Bearer {TOKENS['acme']}", "-w", "\n%{http_code}",
            stack.gateway.url + "/v1/systemone"]
    runs = {"json": ["-H", "Content-Type: application/json", "--data-binary", "@call.json"],
            "zstd": ["-H", "Content-Type: application/json", "-H", "Content-Encoding: zstd", "--data-binary",
                     "@call.json.zst"],
            "multipart": ["-F", "request=@image.json;type=application/json", "-F", "photo=@photo.png;type=image/png"],
            "brotli": ["-H", "Content-Type: application/json", "-H", "Content-Encoding: br", "--data-binary",
                       "@call.json"]}
    out = {}
    for how, extra in runs.items():
        done = subprocess.run([*base, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        body, _, status = done.stdout.rpartition("\n")
        out[how] = (int(status), json.loads(body))
    assert out["json"][0] == out["zstd"][0] == out["multipart"][0] == 200 and out["brotli"][0] == 415
    assert out["json"][1] == out["zstd"][1] and out["json"][1]["model"] == "decider-b"
    assert out["brotli"][1]["detail"]["error_type"] == "unsupported_encoding"
    with queue(stack, "decider-b") as own:
        expected = own.decide(request_of(call), timeout=60).raise_for_error()
    for name, answer in out["json"][1]["answers"].items():
        close(answer, expected.answers[name], 1e-6)


def test_node(stack):
    from test_gateway_node import EXAMPLE, NODE

    if NODE is None:
        pytest.skip("no node on PATH (Debian: apt-get install nodejs)")
    done = subprocess.run([NODE, str(EXAMPLE / "systemone.mjs"), "--url", stack.gateway.url, "--token",
                           TOKENS["acme"]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line["how"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert {line["status"] for line in lines.values()} == {200}
    assert lines["json"]["body"]["model"] == "decider-a" and lines["json"]["id"] == lines["gzip"]["id"]
    answers = [lines[how]["body"]["answers"]["red"]["noul"] for how in ("multipart", "base64")]
    assert answers[0] == pytest.approx(answers[1], abs=1e-6)


def test_undecodable_bodies(stack):
    """What no SDK sends, answered in its shape all the same: a truncated zstd frame, a zstd bomb, an undeclared
    media type."""
    call = json.dumps({"model": "decider-a", "state": "x", "questions": {"q": {"type": "noul"}}}).encode()
    headers = {"Authorization": f"Bearer {TOKENS['acme']}", "Content-Type": "application/json"}
    url = stack.gateway.url + "/v1/systemone"
    cut = httpx.post(url, content=zstd.compress(call)[:-3], headers={**headers, "Content-Encoding": "zstd"})
    assert cut.status_code == 400 and cut.json()["detail"]["error_type"] == "invalid_encoding"
    bomb = zstd.compress(b"{" + b" " * (64 * MAX_BODY) + b"}")
    assert len(bomb) < MAX_BODY
    big = httpx.post(url, content=bomb, headers={**headers, "Content-Encoding": "zstd"})
    assert big.status_code == 413 and big.headers["x-typesafe-request-id"].startswith("req_")
    plain = httpx.post(url, content=call, headers={**headers, "Content-Type": "text/plain"})
    assert plain.status_code == 415


def test_zstd_and_gzip_bodies_of_many_frames_are_taken_within_a_bound(stack):
    """Empty and skippable zstd frames (RFC 8878) around the one that holds the call, and gzip members likewise,
    are valid bodies: answered 200 (they were refused 400: an empty frame ended the read of a chunk); more than
    1000 frames in one body are refused 400, each frame costing a decoder."""
    import gzip
    import struct

    call = json.dumps({"model": "decider-a", "state": "framed", "questions": {"q": {"type": "noul"}}}).encode()
    headers = {"Authorization": f"Bearer {TOKENS['acme']}", "Content-Type": "application/json"}
    url = stack.gateway.url + "/v1/systemone"
    empty, skippable = zstd.compress(b""), struct.pack("<II", 0x184D2A50, 6) + b"ignore"
    framed = empty * 20 + skippable + zstd.compress(call[:10]) + empty * 5 + skippable + zstd.compress(call[10:]) + empty
    members = gzip.compress(b"") * 20 + gzip.compress(call[:10]) + gzip.compress(b"") + gzip.compress(call[10:])
    for encoding, body in (("zstd", framed), ("gzip", members)):
        answered = httpx.post(url, content=body, headers={**headers, "Content-Encoding": encoding}, timeout=60)
        assert answered.status_code == 200 and set(answered.json()["answers"]) == {"q"}, (encoding, answered.text)
    endless = httpx.post(url, content=empty * 1001 + zstd.compress(call), timeout=60,
                         headers={**headers, "Content-Encoding": "zstd"})
    assert endless.status_code == 400 and "more than 1000" in endless.json()["detail"]["message"]


def test_the_python_client_and_the_cli_route_by_model(stack, tmp_path):
    """The queue's own callers name a model as System One callers do; a model nobody serves is refused at once."""
    import sys

    from producer.client import ModelNotServed

    request = {"state": "Routed by name.", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
    with Client(stack.server.url, model="b-alias", model_namespaces=BOTH) as client:
        assert client.decide(request, timeout=60).model == "decider-b" and client.keys.namespace == "beta"
        assert client.stats()["models"] == {"decider-b": {"names": ["decider-b", "b-alias"], "workers": 1}}
    with Client(stack.server.url, model="nobody", model_namespaces=BOTH) as client, \
            pytest.raises(ModelNotServed, match="served: b-alias, decider-a, decider-b"):
        client.submit(request)
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    cli = [sys.executable, "-m", "producer", "submit", str(tmp_path / "requests.jsonl"), "--redis-url",
           stack.server.url, "--model-namespaces", "alpha,beta", "--wait", "--timeout", "60", "--model"]
    done = subprocess.run([*cli, "decider-a"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["model"] == "decider-a", done.stderr
    done = subprocess.run([*cli, "nobody"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no live worker serves the model 'nobody'" in done.stderr
