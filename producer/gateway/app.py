"""The gateway's routes (FastAPI): the queue's request JSON in, its result JSON out, through the project's async
client (``AsyncClient``), one per namespace its keys reach, all on one connection pool.

Nothing is kept between calls: a result is read from its result stream, whichever replica submitted it, so replicas
behind a load balancer need no affinity. Routes raise; replies.py turns each exception into its status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from .. import __version__
from ..client import AsyncClient
from ..core import NotDurable, Prepared, QueueFull, ResultTimeout, WrongResult, prepare
from ..wire.connection import aconnect
from ..wire.keys import GONE_S, ID_PATTERN, NORMAL, Keys, Priority, beat_age
from ..wire.result import Result
from ..wire.schema import ErrorCode, Request, valid_traceparent
from . import replies
from .access import Access, Inflight, Keyring
from .batcher import Batcher
from .bodies import EITHER, MANY, ONE, Batch, describe, parse, seconds
from .config import GatewayConfig
from .front import Front, Metrics
from .replies import READ, SUBMIT, WAIT, Refused, Unsettled

# A request with a deadline is answered deadline_exceeded by the worker that finds it late: wait that long past it.
DEADLINE_GRACE_S = 2.0
# The gateway's own retries: a short ride over a blip, then 503 (a caller retries; the client's own ~12 s would
# hold every call that long while Redis is down). Only a connection refused or dropped is retried, not a command that
# timed out: a frozen Redis is then said within one socket timeout (5 s), not three, and a submit that may have run
# is not sent again behind the caller's back.
RETRIES, RETRY_CAP = 2, 0.2
# Connections beyond the in-flight slots (every call that waits on Redis holds one slot per request, and uses at
# most one connection at a time): /ready's probes, a namespace's first contact.
SPARE_CONNECTIONS = 32
NDJSON = "application/x-ndjson"
CLIENT_GONE = 499  # a decide whose caller went away: nobody reads it, but the metrics count it (nginx's status)


class Gateway:
    """What the routes share: the settings, the keys, the clients by namespace, the counters."""

    def __init__(self, config: GatewayConfig, connection: Any = None) -> None:
        self.config, self.connection = config, connection
        self.keyring, self.inflight, self.metrics = Keyring(config), Inflight(), Metrics()
        self.clients: dict[str, AsyncClient] = {}
        self.batchers: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        deployment = self.config.deployment
        retry = Retry(ExponentialBackoff(RETRY_CAP, 0.02), RETRIES, supported_errors=(redis.ConnectionError,))
        self.connection = self.connection or aconnect(deployment.url, deployment.cluster, **deployment.tls_files(),
                                                      retry=retry, max_connections=self.connections())
        for namespace in self.config.namespaces():
            self.clients[namespace] = AsyncClient(deployment.url, namespace, self.config.max_unfinished,
                                                  deployment.cluster, connection=self.connection,
                                                  shards=deployment.shards, wait_replicas=deployment.wait_replicas)
            self.batchers[namespace] = Batcher(self.clients[namespace])
        yield
        await self.connection.aclose()

    def connections(self) -> int:
        """The pool's size: one connection for each in-flight slot of every key, plus spares. A waiting call holds
        a connection (a blocking read) for as long as it waits, and redis-py's default pool of 100 was shared by
        every tenant: 100 waits of one key refused every other key's calls (503). Each key's waits are bounded by
        its own slots (a long-poll takes one), so with a connection for each slot no tenant can take another's;
        the cost is Redis clients (docs/GATEWAY.md, "Connections")."""
        keys = self.config.keys
        slots = sum(k.max_inflight or self.config.max_inflight_per_key for k in keys) if keys \
            else self.config.max_inflight_per_key
        return slots + SPARE_CONNECTIONS

    def hold(self, http: HttpRequest, count: int) -> Access:
        """``count`` of the caller's in-flight slots, held until the call ends (front.py gives them back): 413 for
        more than its key ever allows (waiting would not help), 429 while it has too many in flight."""
        access: Access = http.state.access
        if count > access.max_inflight:
            raise Refused(413, "batch_too_large", f"{count} requests, over this API key's limit of "
                          f"{access.max_inflight} in flight: it can never be admitted; split it", "requests")
        if not self.inflight.take(access, count):
            raise Refused(429, "too_many_in_flight", f"this API key has {access.max_inflight} requests being "
                          "answered at most; wait for some", headers={"Retry-After": str(replies.RETRY_AFTER_S)})
        http.state.held = [(access.name, count)]
        return access

    def admit(self, http: HttpRequest, requests: list[Request], batch: bool) -> tuple[Access, list[Prepared]]:
        """The caller's requests, checked against its key and the limits, prepared (ids given), its in-flight
        slots held until the call ends (front.py gives them back)."""
        access: Access = http.state.access
        if len(requests) > self.config.max_batch:
            raise Refused(413, "batch_too_large", f"{len(requests)} requests, over the limit of "
                                                  f"{self.config.max_batch} per call", "requests")
        header = valid_traceparent(http.headers.get("traceparent"))
        lanes, seen, out = set(), set(), []
        for index, request in enumerate(requests):
            where = f"requests.{index}." if batch else ""
            lane = Priority(request.priority or NORMAL)
            if lane not in access.lanes:
                raise Refused(403, "lane_forbidden", f"this API key may not send to the {lane} lane",
                              where + "priority")
            if request.reply_to is not None:  # a Redis client's field: the gateway hands results back itself
                raise Refused(422, ErrorCode.INVALID_REQUEST.value, "reply_to is not taken by the gateway: its "
                              "result comes back in the response (or GET /v1/results/{id})", where + "reply_to")
            if request.id is not None and request.id in seen:
                raise Refused(422, ErrorCode.INVALID_REQUEST.value, f"the id {request.id!r} is given twice in one "
                              "call (each request gets exactly one answer by id)", where + "id")
            seen.add(request.id)
            if header and request.traceparent is None:
                request = request.model_copy(update={"traceparent": header})
            lanes.add(str(lane))
            out.append(prepare(request))
        http.state.lane = lanes.pop() if len(lanes) == 1 else "mixed"
        self.hold(http, len(out))
        return access, out

    def wait_for(self, asked: float | None, deadlines: list[int | None]) -> float:
        wait = min(asked or self.config.wait_s, self.config.max_wait_s)
        for deadline_ms in deadlines:
            if deadline_ms is not None:
                wait = min(wait, max(0.0, deadline_ms / 1000 - time.time()) + DEADLINE_GRACE_S)
        return wait

    async def submit(self, namespace: str, prepared: list[Prepared], partial: bool = False) -> list[str]:
        """Submit; with ``partial``, the ids refused by a full queue once some went in (else, and when none went
        in, QueueFull: a 429 naming the accepted and the refused). Any Redis error is Unsettled: it names the ids,
        which may have been queued."""
        refused: list[str] = []
        try:
            await self.batchers[namespace].submit(prepared)
        except QueueFull as full:
            if not (partial and full.accepted):
                self._count(prepared, full.accepted)
                raise
            refused = full.refused
        except redis.RedisError as error:
            raise Unsettled(error, [p.id for p in prepared], SUBMIT) from error
        self._count(prepared, [p.id for p in prepared if p.id not in set(refused)])
        return refused

    def _count(self, prepared: list[Prepared], accepted: list[str]) -> None:
        went = set(accepted)
        for item in prepared:
            if item.id in went:
                self.metrics.queued.labels(str(item.lane)).inc()

    async def lines(self, client: AsyncClient, digests: dict[str, str], refused: list[str],
                    wait: float) -> AsyncIterator[bytes]:
        """One line per request (``digests``: each id's, of what this call sent), each exactly once, as its result
        lands (a result of another request under the id: an id_conflict line); at the deadline a timeout line for
        each missing one (it stays queued), and for each refused by a full queue a not_sent line."""
        ids = list(digests)
        deadline = time.monotonic() + wait
        for request_id in refused:
            yield _line(Result.failure(request_id, ErrorCode.NOT_SENT, "the queue was full: not sent"))
        pending = [r for r in ids if r not in set(refused)]
        try:
            while pending and (left := deadline - time.monotonic()) > 0:
                landed = await client.wait_any(pending, left)
                for request_id in landed:
                    yield _line(landed[request_id].answering(digests[request_id]))
                pending = [r for r in pending if r not in landed]
        except (redis.RedisError, WrongResult) as error:  # mid-batch: the rest still get their one line each
            replies.log.warning("mid-batch: %s: %s", type(error).__name__, error)
            code = replies.NOT_DURABLE if isinstance(error, NotDurable) else "unavailable" \
                if isinstance(error, redis.RedisError) else ErrorCode.INTERNAL
            for request_id in pending:
                yield _line(Result.failure(request_id, code, "the queue could not be read; the request is queued "
                                           f"and will be answered: GET /v1/results/{request_id}"))
            return
        for request_id in pending:
            yield _line(Result.failure(request_id, ErrorCode.TIMEOUT, f"no result within {wait:g} s; the request "
                                       f"stays queued: GET /v1/results/{request_id}"))

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """Redis answers, and each namespace has a live worker (or the gateway's user may not read heartbeats)."""
        try:
            await self.connection.ping()
        except redis.RedisError as error:
            return False, {"redis": f"unreachable: {type(error).__name__}"}
        workers: dict[str, Any] = {}
        for namespace in self.clients:
            try:
                beats = await self.connection.hgetall(Keys(namespace).workers())
            except redis.exceptions.NoPermissionError:
                workers[namespace] = "unknown: this Redis user may not read the workers' heartbeats"
                continue
            now = time.time()
            workers[namespace] = sum(1 for raw in beats.values() if beat_age(raw, now) < GONE_S)
        return all(n != 0 for n in workers.values()), {"redis": "ok", "workers": workers}


async def watched(http: HttpRequest, work: Awaitable[dict[str, Result]], ids: list[str],
                  phase: str) -> dict[str, Result] | None:
    """``work``'s outcome (a wait for the results of ``ids``), or None once the caller has gone away (``work``
    cancelled): its in-flight slots and its Redis connection come back then, not when its wait would have ended.
    A Redis error is Unsettled, naming the ids (``phase``: where the call was). The body is read by now, so the
    next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    try:
        return task.result()
    except (redis.RedisError, WrongResult) as error:
        raise Unsettled(error, ids, phase) from error


async def _disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _line(result: Result) -> bytes:
    return result.model_dump_json(exclude_none=True).encode() + b"\n"


def create_app(config: GatewayConfig, connection: Any = None) -> Front:
    """The ASGI application: the routes behind the front layer (keys, body size, metrics)."""
    gateway = Gateway(config, connection)
    app = FastAPI(title="dq-gateway", version=__version__, lifespan=gateway.lifespan, redoc_url=None,
                  description="The decision queue over HTTP: the queue's request and result JSON (docs/PROTOCOL.md).")
    replies.install(app)
    app.state.gateway = gateway
    failures = {status: {"description": text} for status, text in (
        (401, "no valid API key"), (403, "the key may not use this lane"),
        (409, "id_conflict: the id has another request's result"),
        (413, "body or batch too large (a batch over the key's in-flight limit included)"),
        (422, "invalid input: error.code and error.field say what"), (429, "queue full or too many in flight: "
                                                                          "Retry-After"),
        (503, "Redis unreachable, or replicas did not confirm (not_durable); names the id once known"),
        (504, "no result in time: the id, to fetch later"))}

    # The POST routes: plain Starlette routes, described in the OpenAPI document by bodies.describe.
    async def decide(http: HttpRequest) -> Response:
        body: Request = await parse(http, ONE)
        asked = seconds(http)  # checked before anything is sent
        access, prepared = gateway.admit(http, [body], batch=False)
        client = gateway.clients[access.namespace]
        await gateway.submit(access.namespace, prepared)
        request_id = prepared[0].id
        landed = await watched(http, client.wait_any([request_id], gateway.wait_for(asked, [body.deadline_ms])),
                               [request_id], WAIT)
        if landed is None:
            return Response(status_code=CLIENT_GONE)
        if request_id not in landed:
            raise ResultTimeout("no result in time", missing=[request_id])
        # The result under this id may be another request's (a reused id): then id_conflict, never its answer.
        return replies.result_response(prepared[0].answered_by(landed[request_id]))

    async def decide_batch(http: HttpRequest) -> Response:
        body: Batch = await parse(http, MANY)
        asked = seconds(http)
        access, prepared = gateway.admit(http, body.requests, batch=True)
        client = gateway.clients[access.namespace]
        refused = await gateway.submit(access.namespace, prepared, partial=True)
        wait = gateway.wait_for(asked, [r.deadline_ms for r in body.requests])
        digests = {p.id: p.asked() for p in prepared}
        return StreamingResponse(gateway.lines(client, digests, refused, wait), media_type=NDJSON)

    async def enqueue(http: HttpRequest) -> Response:
        body: Request | Batch = await parse(http, EITHER)
        batch = isinstance(body, Batch)
        access, prepared = gateway.admit(http, body.requests if batch else [body], batch)
        await gateway.submit(access.namespace, prepared)
        return JSONResponse({"ids": [p.id for p in prepared]}, 202)

    posts = [("/v1/decide", "Decide one request and wait for its result", "200", ("Request",), True, decide),
             ("/v1/decide/batch", "Decide many; results as they land (NDJSON)", "200", ("Batch",), True,
              decide_batch),
             ("/v1/requests", "Enqueue; answers the ids at once", "202", ("Request", "Batch"), False, enqueue)]
    for path, *_, endpoint in posts:
        app.add_route(path, endpoint, methods=["POST"], include_in_schema=False)

    @app.get("/v1/results/{request_id}", responses=failures, summary="A result, waiting up to ?wait= seconds")
    async def result(request_id: str, http: HttpRequest,
                     wait: Annotated[float, Query(ge=0, description="seconds to wait for it")] = 0) -> Response:
        access: Access = http.state.access
        if not ID_PATTERN.match(request_id):
            raise Refused(422, ErrorCode.INVALID_REQUEST.value, "an id is 1-128 characters of A-Z a-z 0-9 . _ : -",
                          "id")
        client = gateway.clients[access.namespace]
        gateway.hold(http, 1)  # a long-poll holds a Redis connection as a decide does: it counts against the key
        landed = await watched(http, client.wait_any([request_id], min(wait, config.max_wait_s)), [request_id], READ)
        if landed is None:
            return Response(status_code=CLIENT_GONE)
        found = landed.get(request_id)
        if found is None:
            raise Refused(404, "not_found", "no result for this id: not answered yet, expired, or never sent "
                          "with this key's namespace")
        return Response(found.model_dump_json(exclude_none=True), media_type=replies.JSON)

    @app.get("/health", summary="The process answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Redis reachable and workers alive", responses={503: {"description": "not ready"}})
    async def ready() -> JSONResponse:
        ok, detail = await gateway.ready()
        return JSONResponse({"ready": ok, **detail}, 200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI's description, and the plain routes'
            schema = FastAPI.openapi(app)
            describe(schema, [(*post[:5], failures) for post in posts])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return Front(app, gateway.keyring, gateway.inflight, gateway.metrics, config.max_body_bytes)
