"""``POST /v1/systemone`` and ``GET /v1/models``: the System One API over the queue, for callers written
against it (the official SDKs with ``TYPESAFE_BASE_URL`` pointed here; docs/GATEWAY.md, "System One").

A call passes what every route does (the front layer: the key, the body's size, metrics; admission: lanes, the
key's in-flight slots), then: its body decoded (decoding.py), checked and turned into the queue's request
(translate.py), routed to the namespace whose live workers serve its model (models.py), mapped with its
retries to one request (retries.py), enqueued there unless an earlier attempt did, and answered with the
result as the clients read it. Every answer carries ``x-typesafe-request-id``: the queue's request id once
there is one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from uuid import uuid4

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from ...client.plans import Prepared, QueueFull, prepare
from ...client.served import ServedModel
from ...wire.records import Status
from ...wire.result import Result
from ...wire.schema import MAX_ASSETS, ErrorCode, Request
from ..config import GatewayConfig
from ..front import replies
from ..front.disconnects import CallerGone
from ..front.layer import Dialect, Front
from ..front.replies import JSON, RETRY_AFTER_S, WAIT, Refused
from ..service import Gateway
from . import decoding, translate
from .models import Models
from .retries import BUDGET_S, Retries, after, call_of

CANCELLED = "cancelled"  # a result's error code for a request cancelled before it was computed (docs/PROTOCOL.md)
RETRY_COUNT = "x-typesafe-retry-count"  # the clients' attempt number after the first: counted, never a key
IDEMPOTENCY_KEY = "idempotency-key"
SUBMIT_S = 10.0  # an attached call looks this long for the request another attempt submits (socket timeout: 5 s)
LOOK_S = 0.02, 0.5  # ... first this soon, then twice as long each time up to the second
WATCH_S = 1.0  # a waiting call looks at its model's workers this often
Watch = Callable[[HttpRequest, Awaitable[dict[str, Result]], list[str], str], Awaitable[dict[str, Result]]]


def install(app: FastAPI, front: Front, gateway: Gateway, config: GatewayConfig, watched: Watch) -> None:
    """Add the two routes, and their answers' shape to the front layer (``Dialect``: a refusal it makes there
    reads as the clients expect, every answer carries ``x-typesafe-request-id``); ``watched``: how a route
    waits on results, CallerGone once its caller hangs up."""
    front.speak(Dialect({"/v1/systemone": "systemone", "/v1/models": "models"}, translate.ID_HEADER,
                        translate.fresh_id, translate.reshaped))
    models = Models(lambda: gateway.connection, config.aliases, tuple(config.namespaces()))
    retries = Retries(lambda: gateway.connection, config.retry_window_s or BUDGET_S + config.wait_s)

    async def system_one(http: HttpRequest) -> Response:
        try:
            return await _call(http)
        except CallerGone:  # answered 499 (disconnects.py)
            raise
        except Exception as error:  # noqa: BLE001 - answered as the other routes would, in the clients' shape
            return await _refusal(app, http, error)

    async def _call(http: HttpRequest) -> Response:
        access = http.state.access
        prepared, served = await _read(http)
        name = call_of(access.namespace, served.name, prepared.request_digest(), idempotency_key(http))
        for turn in range(3):  # a request cancelled before this call came: the call's next name, a new id
            if turn:
                fresh = Request.model_validate_json(prepared.body).model_copy(update={"id": uuid4().hex})
                prepared = prepare(fresh)
            claim = await retries.claim(served.namespace, name, prepared.id, prepared.request_digest())
            http.state.typesafe_id = claim.request_id
            if claim.digest != prepared.request_digest():
                raise Refused(422, "idempotency_key_reused", "this Idempotency-Key was sent with another request",
                              "body")
            cancelled_before = False
            if claim.fresh:
                await _submit(served.namespace, name, prepared)
            else:
                gateway.metrics.attached.labels("retry" if RETRY_COUNT in http.headers else "identical").inc()
                found = await _queued(served.namespace, name, claim.request_id)
                cancelled_before = found.state == CANCELLED or found.cancel_requested_ms is not None
            # A hang-up (CallerGone) leaves the request queued and mapped, never cancelled: the SDK's read
            # timeout is one, and the same call follows.
            result = await _wait(http, served, claim.request_id)
            # Cancelled: the answer, unless the cancel came before this attempt did: then it is a new ask,
            # sent afresh under a new id (every attempt that finds that cancel goes to the same next name).
            if result.error is None or result.error.code != CANCELLED or not cancelled_before:
                break
            name = after(name, claim.request_id)
        return _answer(prepared.answered_by(result), served.name, claim.request_id)

    async def _read(http: HttpRequest) -> tuple[Prepared, ServedModel]:
        """The call's body decoded, checked, routed and prepared (its request's JSON, once): nothing else of
        it outlives this, and the call's share of the body budget becomes that JSON's size."""
        state, admission = http.scope["state"], gateway.admission
        body = await decoding.body(http, config.max_body_bytes, lambda more: admission.grow(state, more))
        kind, params = decoding.media_type(http)
        parts: dict[str, decoding.Part] = {}
        if kind == "multipart/form-data":
            parts = decoding.parts(body, params, MAX_ASSETS + 1)
            if "request" not in parts:
                raise Refused(422, "invalid_multipart", "a multipart call needs its request part (the JSON)",
                              "request")
            body = parts.pop("request").data
        elif kind not in ("application/json", ""):
            raise Refused(415, "unsupported_media_type", f"Content-Type {kind[:60]!r} is not taken: "
                          "application/json, or multipart/form-data with images")
        call = translate.parse(body)
        del body
        served = await models.route(http.state.access, call.model)
        request = translate.to_request(call, parts, served.name)
        del call, parts
        _, [prepared] = gateway.admit(http, [request], batch=False)
        gateway.admission.hold(state, len(prepared.body))
        return prepared, served

    async def _submit(namespace: str, name: str, prepared: Prepared) -> None:
        try:
            await gateway.submit(namespace, [prepared])
        except QueueFull:
            await retries.forget(namespace, name)  # nothing went in: the retry must enqueue
            raise

    async def _queued(namespace: str, name: str, request_id: str) -> Status:
        """Where the request another attempt's claim names is, once it is queued (or further on): 429 at
        once where that attempt found the queue full (it dropped its claim, and nothing went in), never a wait
        for a request that no stream holds. A claim whose request is not known within ``SUBMIT_S`` (that
        attempt's submit failed on Redis, and it may have queued it) is waited for."""
        client, deadline = gateway.clients[namespace], time.monotonic() + SUBMIT_S
        look = LOOK_S[0]
        while True:
            found = (await client.status([request_id]))[request_id]
            if found.state != "unknown" or time.monotonic() > deadline:
                return found
            if not await retries.maps(namespace, name, request_id):
                raise Refused(429, "queue_full", "the lane's queue was full when this call was first sent "
                              "(another attempt of it was refused, and nothing was queued); retry",
                              headers={"Retry-After": str(RETRY_AFTER_S)}, request_id=request_id)
            await asyncio.sleep(look)
            look = min(2 * look, LOOK_S[1])  # a submit lands in milliseconds; one that does not, seldom soon

    async def _wait(http: HttpRequest, served: ServedModel, request_id: str) -> Result:
        """The request's result within ``--wait-s``; 504 (it stays queued) without one; 503 at once when no
        live worker serves its model any more (its last worker left while the call waited: the next call would
        be 404), looked at between waits of a second."""
        client, wait = gateway.clients[served.namespace], gateway.wait_for(None)
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            waiting = client.wait_any([request_id], min(WATCH_S, left))
            landed = await watched(http, waiting, [request_id], WAIT)
            if request_id in landed:
                return landed[request_id]
            if not await models.serves(served.namespace, served.name):
                raise Refused(503, "unavailable", f"no live worker serves the model {served.name!r} any more: "
                              "its last worker left while this call waited; the request stays queued, answered "
                              f"if one comes back (GET /v1/results/{request_id})", request_id=request_id,
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        raise Refused(504, ErrorCode.TIMEOUT.value, f"no result in time ({wait:g} s); the request stays queued: "
                      "the same call again waits for it", request_id=request_id)

    async def list_models(http: HttpRequest) -> Response:
        try:
            return JSONResponse(await models.listing(http.state.access))
        except Exception as error:  # noqa: BLE001
            return await _refusal(app, http, error)

    app.add_route("/v1/systemone", system_one, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/models", list_models, methods=["GET"], include_in_schema=False)
    app.add_route("/v1/v1/{rest:path}", _doubled, methods=["GET", "POST"], include_in_schema=False)


async def _doubled(http: HttpRequest) -> Response:
    """A base URL that ends in /v1 (the clients append ``/v1/systemone`` to it): a 404 that says so, in the
    clients' shape, where it was a bare "Not Found". Public, as any unknown path: it reads no body, names no
    tenant."""
    rest = http.path_params["rest"][:60]
    message = (f"no route /v1/v1/{rest}: the base URL ends in /v1, and the System One clients append "
               f"/v1/{rest} themselves; drop the /v1 from it (TYPESAFE_BASE_URL=http://host:8080)")
    body = translate.error_body(404, "not_found", message)
    return Response(body, 404, {translate.ID_HEADER: translate.fresh_id()}, media_type=JSON)


def idempotency_key(http: HttpRequest) -> str | None:
    """The call's ``Idempotency-Key``; an empty one (or blanks) is none: the IETF draft's key is a String
    structured field, and a field that does not parse is ignored as if absent (RFC 9651), so such a call is
    named by its request's digest, never merged with every other call sent with an empty key."""
    key = http.headers.get(IDEMPOTENCY_KEY)
    return key if key is not None and key.strip() else None


def _answer(result: Result, model: str, request_id: str) -> Response:
    headers = {translate.ID_HEADER: request_id}
    if result.ok:
        return Response(translate.response(result, model), 200, headers, media_type=JSON)
    status, error = replies.result_status(result), result.error
    code, message = (str(getattr(error.code, "value", error.code)), error.message) if error else ("error", "")
    return Response(translate.error_body(status, code, message), status, headers, media_type=JSON)


async def _refusal(app: FastAPI, http: HttpRequest, error: Exception) -> Response:
    """``error`` answered with the status the gateway's other routes give it (replies.py), in the System One
    shape: a 422 of this route's own checks lists each problem; any other, the gateway's answer reshaped."""
    if isinstance(error, Refused) and "detail" in error.extra:
        status, headers = error.status, dict(error.headers)
        body = translate.error_body(status, error.code, error.message, detail=error.extra["detail"])
    else:
        handler = next((app.exception_handlers[kind] for kind in type(error).__mro__
                        if kind in app.exception_handlers), None)
        if handler is None:
            raise error
        reply = await handler(http, error)
        status, body = reply.status_code, translate.reshaped(reply.status_code, bytes(reply.body))
        headers = {k: v for k, v in reply.headers.items() if k.lower() in ("retry-after", "location")}
    headers[translate.ID_HEADER] = getattr(http.state, "typesafe_id", None) or translate.fresh_id()
    return Response(body, status, headers, media_type=JSON)
