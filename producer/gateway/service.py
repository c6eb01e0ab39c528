"""What every route of the gateway calls (routes.py): admission (the caller's key, lanes, batch size and in-flight
slots), submission through the project's async client (``AsyncClient``, one per namespace its keys reach, all on
one connection pool), results streamed as they land, and readiness.

Nothing is kept between calls: a result is read from its result stream, whichever replica submitted it, so replicas
behind a load balancer need no affinity.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any

import redis
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ..client import AsyncClient
from ..plans import NotDurable, Prepared, QueueFull, WrongResult, prepare
from ..wire import traces
from ..wire.connection import aconnect
from ..wire.keys import GONE_S, NORMAL, Keys, Priority, beat_age
from ..wire.result import Result
from ..wire.schema import ErrorCode, Request, valid_traceparent
from . import replies
from .access import Access, Inflight, Keyring
from .batcher import Batcher
from .config import GatewayConfig
from .front import Metrics
from .replies import SUBMIT, Refused, Unsettled

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


class Gateway:
    """What the routes share: the settings, the keys, the clients by namespace, the counters."""

    def __init__(self, config: GatewayConfig, connection: Any = None) -> None:
        self.config, self.connection = config, connection
        self.keyring, self.inflight, self.metrics = Keyring(config), Inflight(), Metrics()
        self.clients: dict[str, AsyncClient] = {}
        self.batchers: dict[str, Batcher] = {}
        self.tracer = traces.tracer("dq-gateway")  # None: tracing off

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
        # with tracing on, the call's span (producer/wire/traces.py); else the caller's own traceparent, passed on
        header = traces.current() or valid_traceparent(http.headers.get("traceparent"))
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
        enqueue = self.tracer.start_as_current_span("dq.enqueue", attributes={
            "dq.namespace": namespace, "dq.requests": len(prepared)}) if self.tracer is not None else nullcontext()
        try:
            with enqueue:
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

    async def no_worker(self, client: AsyncClient) -> bool:
        """No worker of the client's namespace is alive (False when unknown: Redis failing, heartbeats unreadable)."""
        try:
            return await client.live_workers() == 0
        except redis.RedisError:
            return False

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


def _line(result: Result) -> bytes:
    return result.model_dump_json(exclude_none=True).encode() + b"\n"
