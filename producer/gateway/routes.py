"""The gateway's routes (FastAPI): the queue's request JSON in, its result JSON out, each through the service
(service.py). Routes raise; replies.py turns each exception into its status.
"""

from __future__ import annotations

from typing import Annotated, Any

import redis
from fastapi import FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from ..client.plans import Prepared
from ..wire.keys import GONE_S, ID_PATTERN, PROTOCOL
from ..wire.result import Result
from ..wire.schema import ErrorCode, Request
from . import cancels, pages
from .bodies import EITHER, MANY, ONE, Batch, describe, parse, seconds
from .config import GatewayConfig
from .front import replies
from .front.access import Access
from .front.disconnects import CallerGone, unless_gone
from .front.layer import Front
from .front.replies import READ, WAIT, Refused, Unsettled
from .openapi import complete
from .service import Gateway
from .systemone import routes as systemone

NDJSON = "application/x-ndjson"
DIGEST = "^[0-9a-f]{32}$"


async def waited(http: HttpRequest, work: Any, ids: list[str], phase: str,
                 digests: list[str] | None = None) -> dict[str, Result]:
    """``work``'s outcome (a wait for the results of ``ids``), unless the caller goes away (disconnects.py:
    499). A Redis error is Unsettled, naming the ids and their digests (``phase``: where the call was)."""
    try:
        return await unless_gone(http, work)
    except redis.RedisError as error:
        raise Unsettled(error, ids, phase, digests) from error


def no_result(prepared: Prepared, wait: float, no_worker: str | None) -> Refused:
    """504: no result within the wait, and why when no worker of the namespace is alive; the request stays
    queued, read later by id and digest."""
    where = f"/v1/results/{prepared.id}?digest={prepared.request_digest()}"
    why = "the request stays queued"
    if no_worker:
        why = (f"no live worker in namespace {no_worker!r} (no heartbeat in the last {GONE_S} s: none "
               "started, or all gone); the request stays queued until one starts")
    return Refused(504, ErrorCode.TIMEOUT.value, f"no result in time ({wait:g} s); {why}: GET {where}",
                   headers={"Location": where}, request_id=prepared.id, digest=prepared.request_digest())


def create_app(config: GatewayConfig, connection: Any = None) -> Front:
    """The ASGI application: the routes behind the front layer (keys, admission, metrics); its ``gateway``
    attribute has the connections' limits for the server (__main__.py)."""
    gateway = Gateway(config, connection)
    app = FastAPI(title="dq-gateway", version=__version__, lifespan=gateway.lifespan, docs_url=None,
                  redoc_url=None,
                  description="The decision queue over HTTP: the queue's request and result JSON "
                              "(docs/PROTOCOL.md).")
    replies.install(app, gateway.failures)
    pages.install(app)  # /docs and /redoc, their assets served here (no CDN)
    app.state.gateway = gateway

    # The POST routes: plain Starlette routes, described in the OpenAPI document by bodies.describe.
    async def decide(http: HttpRequest) -> Response:
        body: Request = await parse(http, ONE)
        asked = seconds(http)  # checked before anything is sent
        cancels.keeps(http)
        access, prepared = gateway.admit(http, [body], batch=False)
        client = gateway.clients[access.namespace]
        await gateway.submit(access.namespace, prepared)
        request_id, wait = prepared[0].id, gateway.wait_for(asked, body.deadline_ms)
        try:
            landed = await waited(http, client.wait_any([request_id], wait), [request_id], WAIT,
                                  [prepared[0].request_digest()])
        except CallerGone:  # answered 499; what it waited for is cancelled unless its key or call keeps it
            cancels.hung_up(gateway, http, [request_id])
            raise
        if request_id not in landed:  # with why, when no worker of the namespace is alive to answer it
            raise no_result(prepared[0], wait, access.namespace if await gateway.no_worker(client) else None)
        # The result under this id may be another request's (a reused id): then id_conflict, never its answer.
        return replies.result_response(prepared[0].answered_by(landed[request_id]))

    async def decide_batch(http: HttpRequest) -> Response:
        body: Batch = await parse(http, MANY)
        asked = seconds(http)
        cancels.keeps(http)
        access, prepared = gateway.admit(http, body.requests, batch=True)
        client = gateway.clients[access.namespace]
        refused = await gateway.submit(access.namespace, prepared, partial=True)
        waits = {p.id: gateway.wait_for(asked, r.deadline_ms) for p, r in zip(prepared, body.requests)}
        lines = gateway.lines(client, {p.id: p for p in prepared}, refused, waits)
        sent = [p.id for p in prepared if p.id not in set(refused)]
        return StreamingResponse(cancels.watched_lines(gateway, http, lines, sent), media_type=NDJSON)

    async def enqueue(http: HttpRequest) -> Response:
        body: Request | Batch = await parse(http, EITHER)
        batch = isinstance(body, Batch)
        access, prepared = gateway.admit(http, body.requests if batch else [body], batch)
        await gateway.submit(access.namespace, prepared)
        # Each id's digest: GET /v1/results/{id}?digest= then answers this request's result only.
        return JSONResponse({"ids": [p.id for p in prepared],
                             "digests": [p.request_digest() for p in prepared]}, 202)

    posts = [("/v1/decide", "Decide one request and wait for its result", "200", ("Request",), True, decide),
             ("/v1/decide/batch", "Decide many; results as they land (NDJSON)", "200", ("Batch",), True,
              decide_batch),
             ("/v1/requests", "Enqueue; answers the ids and digests at once", "202", ("Request", "Batch"),
              False, enqueue)]
    for path, *_, endpoint in posts:
        app.add_route(path, endpoint, methods=["POST"], include_in_schema=False)

    @app.get("/v1/results/{request_id}", summary="A result, waiting up to ?wait= seconds")
    async def result(request_id: str, http: HttpRequest,
                     wait: Annotated[float, Query(ge=0, description="seconds to wait for it")] = 0,
                     digest: Annotated[str | None, Query(pattern=DIGEST, description="the request's digest (the "
                                                         "202's): a result of another request is 409 id_conflict")]
                     = None) -> Response:
        access: Access = http.state.access  # its in-flight slot was taken before: a long-poll holds one
        if not ID_PATTERN.match(request_id):
            raise Refused(422, ErrorCode.INVALID_REQUEST.value,
                          "an id is 1-128 characters of A-Z a-z 0-9 . _ : -", "id")
        client = gateway.clients[access.namespace]
        landed = await waited(http, client.wait_any([request_id], min(wait, config.max_wait_s)), [request_id],
                              READ, [digest] if digest else None)
        found = landed.get(request_id)
        if found is None:
            raise Refused(404, "not_found", "no result for this id: not answered yet, expired, or never sent "
                          "with this key's namespace")
        # With the caller's digest, another request's result is not its answer; an unreadable one never is.
        answer = found.answering(digest) if digest is not None else found
        if answer.error is not None and answer.error.code == ErrorCode.ID_CONFLICT:
            return replies.result_response(answer)  # 409
        return Response(answer.model_dump_json(exclude_none=True), media_type=replies.JSON)

    @app.get("/health", summary="The process answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="The gateway can serve: Redis reachable on its own connection, its limits not "
                               "exhausted")
    async def ready() -> JSONResponse:
        ok, detail = await gateway.ready()
        return JSONResponse({"ready": ok, **detail}, 200 if ok else 503)

    @app.get("/info", summary="What runs: the gateway's version and wire protocol")
    async def info() -> dict[str, str]:
        return {"version": __version__, "protocol": PROTOCOL}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI's description, the plain routes', every route's responses
            describe(FastAPI.openapi(app), [post[:5] for post in posts])
            complete(app.openapi_schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    front = Front(app, gateway.keyring, gateway.admission, gateway.metrics, gateway.tracer)
    front.gateway = gateway
    cancels.install(app, gateway)
    systemone.install(app, front, gateway, config, waited)
    return front
