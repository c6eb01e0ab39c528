"""What every route of the gateway calls (routes.py): the checks of a call's requests (lanes, batch size, the
rest of its in-flight slots: admission.py), submission through the project's async client (``AsyncClient``,
one per namespace its keys reach, all on one connection pool), results streamed as they land, and readiness.

Nothing is kept between calls: a result is read from its result stream, whichever replica submitted it, so
replicas behind a load balancer need no affinity.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any

import redis
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff

from ..client import AsyncClient
from ..client.plans import NotDurable, Prepared, QueueFull, prepare
from ..plumbing import traces
from ..plumbing.connection import aconnect
from ..wire.keys import NORMAL, Priority
from ..wire.result import Result
from ..wire.schema import ErrorCode, Request, valid_traceparent
from .batcher import Batcher
from .config import GatewayConfig
from .front import replies
from .front.access import Access, Inflight, Keyring
from .front.admission import Admission
from .front.connections import Connections, Limits
from .front.redis_failures import RedisFailures
from .front.replies import SUBMIT, Refused, Unsettled
from .metrics import Metrics

# A request with a deadline is answered deadline_exceeded by the worker that finds it late: wait that long
# past it.
DEADLINE_GRACE_S = 2.0
# The gateway's own retries: a short ride over a blip, then 503 (a caller retries; the client's own ~12 s
# would hold every call that long while Redis is down). Only a connection refused or dropped is retried, not a
# command that timed out: a frozen Redis is then said within one socket timeout (5 s), not three, and a submit
# that may have run is not sent again behind the caller's back.
RETRIES, RETRY_CAP = 2, 0.2
# Connections beyond the in-flight slots (every call that waits on Redis holds one slot per request, and uses
# at most one connection at a time): a namespace's first contact.
SPARE_CONNECTIONS = 32
# Readiness asks Redis on a connection of its own, at most this often (a flood of /ready costs one PING a
# second), and gives up on an answer after this long (a probe's timeout is a few seconds).
READY_EVERY_S, READY_TIMEOUT_S = 1.0, 2.0


class Gateway:
    """What the routes share: the settings, the keys, the clients by namespace, the counters."""

    def __init__(self, config: GatewayConfig, connection: Any = None) -> None:
        self.config, self.connection = config, connection
        self.keyring, self.metrics = Keyring(config), Metrics()
        self.admission = Admission(Inflight(), config.max_body_bytes, config.max_body_bytes_in_flight,
                                   config.body_timeout_s)
        self.connections = Connections(Limits(config.max_connections, config.max_header_bytes,
                                              config.header_timeout_s), self.metrics)
        self.clients: dict[str, AsyncClient] = {}
        self.batchers: dict[str, Batcher] = {}
        self.probe: Any = None  # readiness's own client: never the tenants' pool
        self.probed: tuple[float, str] = (float("-inf"), "")  # when Redis was last asked, and what it said
        self.probing: asyncio.Future[str] | None = None
        self.tracer = traces.tracer("dq-gateway")  # None: tracing off
        self.failures = RedisFailures(self.metrics, self._answers)  # each Redis failure counted, logged once

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        deployment = self.config.deployment
        retry = Retry(ExponentialBackoff(RETRY_CAP, 0.02), RETRIES, supported_errors=(redis.ConnectionError,))
        options = deployment.options()
        self.connection = self.connection or aconnect(deployment.url, deployment.cluster, **options,
                                                      retry=retry, max_connections=pool_size(self.config))
        for namespace in self.config.namespaces():
            self.clients[namespace] = AsyncClient(deployment.url, namespace, self.config.max_unfinished,
                                                  deployment.cluster, connection=self.connection,
                                                  shards=deployment.shards,
                                                  wait_replicas=deployment.wait_replicas, **options)
            self.batchers[namespace] = Batcher(self.clients[namespace])
        self.probe = aconnect(deployment.url, deployment.cluster, **options, retry=Retry(NoBackoff(), 0),
                              socket_timeout=READY_TIMEOUT_S, socket_connect_timeout=READY_TIMEOUT_S)
        yield
        # What each client made of its own (durable mode on a cluster); not the pool.
        for client in self.clients.values():
            await client.close()
        await self.failures.close()
        await self.connection.aclose()
        await self.probe.aclose()

    def admit(self, http: HttpRequest, requests: list[Request], batch: bool) -> tuple[Access, list[Prepared]]:
        """The caller's requests, checked against its key and the limits, prepared (ids given), an in-flight
        slot held for each until the call ends (the front layer took the first and gives them back)."""
        access: Access = http.state.access
        if len(requests) > self.config.max_batch:
            raise Refused(413, "batch_too_large", f"{len(requests)} requests, over the limit of "
                                                  f"{self.config.max_batch} per call", "requests")
        # with tracing on, the call's span (producer/plumbing/traces.py); else the caller's own traceparent, passed on
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
        self.admission.more(http, len(out))
        return access, out

    def wait_for(self, asked: float | None, deadline_ms: int | None = None) -> float:
        """How long a call waits for one request's result: what it asked (or ``--wait-s``), at most
        ``--max-wait-s``, and no longer than its request's own deadline and the grace its worker answers
        in."""
        wait = min(asked or self.config.wait_s, self.config.max_wait_s)
        if deadline_ms is not None:
            wait = min(wait, max(0.0, deadline_ms / 1000 - time.time()) + DEADLINE_GRACE_S)
        return wait

    async def submit(self, namespace: str, prepared: list[Prepared], partial: bool = False) -> list[str]:
        """Submit; with ``partial``, the ids refused by a full queue once some went in (else, and when none
        went in, QueueFull: a 429 naming the accepted and the refused). Any Redis error is Unsettled: it names
        the ids, which may have been queued."""
        refused: list[str] = []
        enqueue = nullcontext() if self.tracer is None else self.tracer.start_as_current_span(
            "dq.enqueue", attributes={"dq.namespace": namespace, "dq.requests": len(prepared)})
        try:
            with enqueue:
                await self.batchers[namespace].submit(prepared)
        except QueueFull as full:
            if not (partial and full.accepted):
                self._count(prepared, full.accepted)
                raise
            refused = full.refused
        except redis.RedisError as error:
            raise Unsettled(error, [p.id for p in prepared], SUBMIT, [p.request_digest() for p in prepared]) from error
        self._count(prepared, [p.id for p in prepared if p.id not in set(refused)])
        return refused

    def _count(self, prepared: list[Prepared], accepted: list[str]) -> None:
        went = set(accepted)
        for item in prepared:
            if item.id in went:
                self.metrics.queued.labels(str(item.lane)).inc()

    async def lines(self, client: AsyncClient, asked: dict[str, Prepared], refused: list[str],
                    waits: dict[str, float]) -> AsyncIterator[bytes]:
        """One line per request (``asked``: what this call sent under each id), each exactly once, as its
        result lands (a result of another request under the id: an id_conflict line); past its own wait
        (``waits``: a request's deadline shortens its own, not the others') a timeout line for each missing
        one (it stays queued), and for each refused by a full queue a not_sent line. Every line carries its
        request's digest."""
        started = time.monotonic()
        for request_id in refused:
            yield _line(Result.failure(request_id, ErrorCode.NOT_SENT, "the queue was full: not sent",
                                       digest=asked[request_id].request_digest()))
        pending = [r for r in asked if r not in set(refused)]
        try:
            while pending:
                now = time.monotonic()
                for request_id in [r for r in pending if started + waits[r] <= now]:
                    yield _line(Result.failure(request_id, ErrorCode.TIMEOUT,
                                               f"no result within {waits[request_id]:g} s; the request stays "
                                               f"queued: {_fetch(asked[request_id])}",
                                               digest=asked[request_id].request_digest()))
                pending = [r for r in pending if started + waits[r] > now]
                if not pending:
                    return
                landed = await client.wait_any(pending, min(started + waits[r] for r in pending) - now)
                for request_id in landed:
                    yield _line(asked[request_id].answered_by(landed[request_id]))
                pending = [r for r in pending if r not in landed]
        except redis.RedisError as error:  # mid-batch: the rest still get their one line each
            self.failures.failed(error, "a streamed batch's wait")
            code = replies.NOT_DURABLE if isinstance(error, NotDurable) else "unavailable"
            for request_id in pending:
                yield _line(Result.failure(request_id, code, "the queue could not be read; the request is "
                                           f"queued and will be answered: {_fetch(asked[request_id])}",
                                           digest=asked[request_id].request_digest()))

    async def no_worker(self, client: AsyncClient) -> bool:
        """No worker of the client's namespace is alive (False when unknown: Redis fails, beats unreadable)."""
        try:
            return await client.live_workers() == 0
        except redis.RedisError:
            return False

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """The gateway's own ability to serve: Redis answers a PING on readiness's own connection (never the
        tenants' pool: a flood of /ready cannot empty it, nor be refused by it), asked at most once a second,
        and its own limits have room (connections, the body budget). Whether workers are alive is not its
        readiness: taking the gateway out of its Service would stop callers from queueing while workers
        roll."""
        last, said = self.probed
        if time.monotonic() - last >= READY_EVERY_S:
            if self.probing is None or self.probing.done():
                self.probing = asyncio.ensure_future(self._ping())
            said = await asyncio.shield(self.probing)
        full = {"connections": self.connections.full, "body budget": self.admission.exhausted}
        detail = {"redis": said, "connections": f"{len(self.connections.open)} of "
                                                f"{self.connections.limits.max_connections}",
                  "limits": ", ".join(name for name, at in full.items() if at) or "room"}
        return said == "ok" and not any(full.values()), detail

    async def _answers(self) -> bool:
        """Whether Redis answers a PING on readiness's own connection (and readiness learns it too)."""
        return await self._ping() == "ok"

    async def _ping(self) -> str:
        try:
            await self.probe.ping()
            said = "ok"
        except (redis.RedisError, OSError) as error:
            said = f"unreachable: {type(error).__name__}"
        self.probed = (time.monotonic(), said)
        return said


def pool_size(config: GatewayConfig) -> int:
    """The tenants' Redis pool: one connection for each in-flight slot of every key, plus spares. A waiting
    call holds a connection (a blocking read) for as long as it waits, and redis-py's default pool of 100 was
    shared by every tenant: 100 waits of one key refused every other key's calls (503). Each key's waits are
    bounded by its own slots (a long-poll takes one), so with a connection for each slot no tenant can take
    another's; the cost is Redis clients (docs/GATEWAY.md, "Connections")."""
    keys = config.keys
    slots = sum(k.max_inflight or config.max_inflight_per_key for k in keys) if keys else config.max_inflight_per_key
    return slots + SPARE_CONNECTIONS


def _fetch(prepared: Prepared) -> str:
    """Where a request's result is read later: its id, and its digest, so that only its own is answered."""
    return f"GET /v1/results/{prepared.id}?digest={prepared.request_digest()}"


def _line(result: Result) -> bytes:
    return result.model_dump_json(exclude_none=True).encode() + b"\n"
