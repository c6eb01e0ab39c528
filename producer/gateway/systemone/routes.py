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

from collections.abc import Awaitable, Callable
from uuid import uuid4

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from ...client.plans import Prepared, QueueFull, prepare
from ...wire.result import Result
from ...wire.schema import MAX_ASSETS, ErrorCode, Request
from ..config import GatewayConfig
from ..front import replies
from ..front.disconnects import CallerGone
from ..front.layer import Dialect, Front
from ..front.replies import JSON, WAIT, Refused
from ..service import Gateway
from . import decoding, translate
from .models import Models
from .retries import BUDGET_S, Retries, after, call_of

CANCELLED = "cancelled"  # a result's error code for a request cancelled before it was computed (docs/PROTOCOL.md)
RETRY_COUNT = "x-typesafe-retry-count"  # the clients' attempt number after the first: counted, never a key
Watch = Callable[[HttpRequest, Awaitable[dict[str, Result]], list[str], str], Awaitable[dict[str, Result]]]


def install(app: FastAPI, front: Front, gateway: Gateway, config: GatewayConfig, watched: Watch) -> None:
    """Add the two routes, and their answers' shape to the front layer (``Dialect``: a refusal it makes there
    reads as the clients expect, every answer carries ``x-typesafe-request-id``); ``watched``: how a route
    waits on results, CallerGone once its caller hangs up."""
    front.speak(Dialect({"/v1/systemone": "systemone", "/v1/models": "models"}, translate.ID_HEADER,
                        translate.fresh_id, translate.reshaped))
    models = Models(lambda: gateway.connection, config.aliases)
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
        body = await decoding.body(http, config.max_body_bytes)
        kind, params = decoding.media_type(http)
        parts: dict[str, decoding.Part] = {}
        if kind == "multipart/form-data":
            parts = decoding.parts(body, params, MAX_ASSETS + 1)
            if "request" not in parts:
                raise Refused(422, "invalid_multipart", "a multipart call needs its request part (the JSON)",
                              "request")
            body = bytes(parts.pop("request").data)
        elif kind not in ("application/json", ""):
            raise Refused(415, "unsupported_media_type", f"Content-Type {kind[:60]!r} is not taken: "
                          "application/json, or multipart/form-data with images")
        call = translate.parse(body)
        served = await models.route(access, call.model)
        request = translate.to_request(call, parts, served.name)
        _, [prepared] = gateway.admit(http, [request], batch=False)
        name = call_of(access.namespace, served.name, prepared.request_digest(), http.headers.get("idempotency-key"))
        client = gateway.clients[served.namespace]
        for turn in range(3):  # a request cancelled under the call: the call's next name, a new id (retries.py)
            if turn:
                prepared = prepare(Request.model_validate_json(prepared.body).model_copy(update={"id": uuid4().hex}))
            claim = await retries.claim(served.namespace, name, prepared.id, prepared.request_digest())
            http.state.typesafe_id = claim.request_id
            if claim.digest != prepared.request_digest():
                raise Refused(422, "idempotency_key_reused", "this Idempotency-Key was sent with another request",
                              "body")
            if claim.fresh:
                await _submit(served.namespace, name, prepared)
            else:
                gateway.metrics.attached.labels("retry" if RETRY_COUNT in http.headers else "identical").inc()
            # A hang-up (CallerGone) leaves the request queued and mapped, never cancelled: the SDK's read
            # timeout is one, and the same call follows. A result `cancelled` found below is never an answer.
            wait = gateway.wait_for(None)
            landed = await watched(http, client.wait_any([claim.request_id], wait), [claim.request_id], WAIT)
            result = landed.get(claim.request_id)
            if result is None:
                raise Refused(504, ErrorCode.TIMEOUT.value, f"no result in time ({wait:g} s); the request stays "
                              "queued: the same call again waits for it", request_id=claim.request_id)
            if result.error is None or result.error.code != CANCELLED:
                break
            name = after(name, claim.request_id)
        return _answer(prepared.answered_by(result), served.name, claim.request_id)

    async def _submit(namespace: str, name: str, prepared: Prepared) -> None:
        try:
            await gateway.submit(namespace, [prepared])
        except QueueFull:
            await retries.forget(namespace, name)  # nothing went in: the retry must enqueue
            raise

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
