"""The Python producer: submit requests, wait for their results, read queue stats; blocking (``Client``) or
asyncio (``AsyncClient``), with the same methods.

Both faces run the plans of one core (``producer.plans.Producer``) against their connection: the logic is written
once, only the I/O differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import arrivals, served, stats
from .plans import (NO_WORKER_S, Function, InvalidRequest, Load, Pipeline, Plan, Prepared, Producer, QueueFull,
                   ResultTimeout, Step, Submittable, WrongResult, prepare)
from .wire import library, sentinel
from .wire.connection import WAIT_MS, Deployment, aconnect, connect
from .wire.errors import DecisionQueueError, ModelNotServed, NotDurable, RedisUnreachable
from .wire.keys import Keys
from .wire.library import LibraryUnavailable
from .wire.result import Result, ResultError
from .wire.supported import Server, UnsupportedServer, acheck, check

__all__ = ["AsyncClient", "Client", "DecisionQueueError", "InvalidRequest", "LibraryUnavailable", "ModelNotServed",
           "NotDurable", "Prepared", "QueueFull", "RedisUnreachable", "ResultError", "ResultTimeout",
           "UnsupportedServer", "WrongResult", "aconnect", "connect", "prepare"]
T = TypeVar("T")
# What a first contact that never reached a server raises (RedisClusterException: no node of a cluster answered).
UNREACHED = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException)


def _unreachable(where: str, error: BaseException) -> RedisUnreachable:
    return RedisUnreachable(f"Redis at {where} cannot be reached: {error}")


class _Face:
    """What both faces hold: the connection (made from the deployment unless one is given) and the core.

    Arguments left out come from the worker's ``DQ_*`` variables (``DQ_REDIS_URL``, ``DQ_NAMESPACE``,
    ``DQ_REDIS_CLUSTER``, ``DQ_REDIS_TLS_*``) and ``DQ_SHARDS``, then the defaults. ``max_unfinished``: the
    backpressure limit per shard (0: none). ``wait_replicas`` (``DQ_WAIT_REPLICAS``): durable mode, an enqueue is
    acknowledged and a result returned only once that many replicas have it, else NotDurable names the ids.
    ``no_worker_s``: a wait (``wait``, ``wait_many``, ``decide``) during which no worker of the namespace is alive
    ends after this many seconds, not its whole timeout, with a ResultTimeout that says "no live worker in namespace
    X" (``no_worker``); None: the whole timeout. ``model``: the first of ``model_namespaces`` whose live workers
    serve it, or ModelNotServed (producer/served.py). ``options``: redis-py connection options (``ssl_ca_certs``).

    The first call asks the server what it is, once and without retries: a Redis that is down raises
    ``RedisUnreachable`` within the socket timeout (5 s), not after the retries that ride out a restart.
    """

    _connect: Any  # connect or aconnect
    server: Server | None = None  # what the server said at first contact (producer/wire/supported.py)
    routed: served.ServedModel | None = None  # where ``model`` is served, once found

    def __init__(self, url: str | None = None, namespace: str | None = None, max_unfinished: int = 100_000,
                 cluster: bool | None = None, connection: Any = None, shards: int | None = None,
                 wait_replicas: int | None = None, no_worker_s: float | None = NO_WORKER_S, model: str | None = None,
                 model_namespaces: Iterable[str] | None = None, **options: Any) -> None:
        self.deployment = Deployment.resolve(url=url, namespace=namespace, cluster=cluster, shards=shards,
                                             wait_replicas=wait_replicas)
        self.model, self.model_namespaces = model, list(model_namespaces or [self.deployment.namespace])
        self._options = {**self.deployment.tls_files(), **options}
        self._given = connection is not None
        try:  # a cluster client connects here already
            self.redis = connection or self._connect(self.deployment.url, self.deployment.cluster, **self._options)
        except UNREACHED as error:
            raise _unreachable(self.deployment.safe_url, error) from None
        cluster = self.deployment.cluster or isinstance(self.redis, (redis.RedisCluster, aioredis.RedisCluster))
        self.keys = Keys(self.deployment.namespace)
        self.core = Producer(self.keys, self.deployment.shards, max_unfinished, cluster, self.deployment.wait_replicas,
                             no_worker_s)

    @property
    def shards(self) -> int:
        return self.core.shards

    @property
    def max_unfinished(self) -> int:
        return self.core.max_unfinished


class Client(_Face):
    """The blocking producer."""

    _connect = staticmethod(connect)

    def submit(self, request: Submittable) -> str:
        """Enqueue one request; returns its id. Raises InvalidRequest (nothing sent) or QueueFull."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[Submittable]) -> list[str]:
        """Enqueue requests in batches, each all or nothing; returns their ids in order. On backpressure raises
        QueueFull, whose ``accepted`` and ``refused`` say which went in."""
        return self._run(self.core.submit_many(requests))

    def fetch(self, request_id: str) -> Result | None:
        """The result if it is there (non-blocking)."""
        return self._run(self.core.fetch(request_id))

    def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        """The result of one request, blocking up to ``timeout`` seconds (None: forever); raises ResultTimeout."""
        return self.wait_many([request_id], timeout)[request_id]

    def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0, *, check: bool = True
                  ) -> dict[str, Result]:
        """Results of all ``request_ids`` by id, in their order; raises ResultTimeout naming how many are missing.
        A result of another request under an id this client submitted is returned as ``id_conflict``; ``check``
        False: every result as stored (for a reader that compares each with its own request's digest)."""
        return self._run(self.core.wait_many(request_ids, timeout, check))

    def wait_any(self, request_ids: Iterable[str], timeout: float = 1.0) -> dict[str, Result]:
        """Those of the results that are there; when none is, the first to land within ``timeout`` seconds (empty:
        none did). Results as they land: call again with the ids still missing."""
        return self._run(arrivals.wait_any(self.core, request_ids, timeout))

    def decide(self, request: Submittable, timeout: float | None = 60.0) -> Result:
        """Submit and wait."""
        return self._run(self.core.decide(request, timeout))

    def stats(self) -> dict[str, Any]:
        """Queue totals and per-shard figures (see ``Producer.stats``)."""
        return self._run(stats.stats(self.core))

    def live_workers(self) -> int | None:
        """Live workers of the namespace (a heartbeat in the last 30 s); None when the user may not look."""
        return self._run(self.core.live_workers())

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _first_contact(self) -> Server:
        """UnsupportedServer unless Redis >= 7.0 or Valkey >= 7.2; RedisUnreachable at once when it is down."""
        where = self.deployment.safe_url
        try:
            probe = self.redis if self._given else connect(self.deployment.url, self.deployment.cluster,
                                                           **{**self._options, "retry": Retry(NoBackoff(), 0)})
            try:
                return check(probe, where)
            finally:
                if probe is not self.redis:
                    probe.close()
        except UNREACHED as error:
            raise _unreachable(where, error) from None

    def _run(self, plan: Plan[T]) -> T:
        if self.server is None:
            self.server = self._first_contact()
        plan = served.routing(self, plan)
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(reply)
            except StopIteration as finished:
                return finished.value
            try:
                reply, error = self._do(step), None
            except Exception as failed:  # handed to the plan: it knows which errors mean what
                reply, error = None, failed

    def _do(self, step: Step) -> Any:
        try:
            reply = self._send(step)
        except redis.ResponseError as error:  # "WAIT cannot be used with replica instances": a demoted primary
            if isinstance(step, Pipeline) and step.wait and "replica" in str(error):
                sentinel.follow(self.redis)
                raise NotDurable(f"the node that answered is a replica now: {error}", [], 0, step.wait) from None
            raise
        if isinstance(step, (Function, Pipeline)) and step.wait and reply[-1] < step.wait:
            sentinel.follow(self.redis)  # a replaced primary that still answers: to the promoted one
        return reply

    def _send(self, step: Step) -> Any:
        if isinstance(step, Function) and step.wait:  # WAIT counts its connection's writes: one pipeline
            with self.redis.pipeline(transaction=False) as pipe:
                return pipe.fcall(step.name, len(step.keys), *step.keys, *step.args).wait(step.wait, WAIT_MS).execute()
        if isinstance(step, Function):
            return self.redis.fcall(step.name, len(step.keys), *step.keys, *step.args)
        if isinstance(step, Load):  # only when missing: a producer never replaces the workers' revision
            return library.ensure(self.redis, replace_older=False)
        if isinstance(step, Pipeline):
            with self.redis.pipeline(transaction=False) as pipe:
                for call in step.calls:
                    getattr(pipe, call.method)(*call.args, **call.kwargs)
                return pipe.execute()
        return getattr(self.redis, step.method)(*step.args, **step.kwargs)


class AsyncClient(_Face):
    """The asyncio producer: ``Client``'s methods, awaited."""

    _connect = staticmethod(aconnect)

    async def submit(self, request: Submittable) -> str:
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: Iterable[Submittable]) -> list[str]:
        return await self._run(self.core.submit_many(requests))

    async def fetch(self, request_id: str) -> Result | None:
        return await self._run(self.core.fetch(request_id))

    async def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        return (await self.wait_many([request_id], timeout))[request_id]

    async def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0, *, check: bool = True
                        ) -> dict[str, Result]:
        return await self._run(self.core.wait_many(request_ids, timeout, check))

    async def wait_any(self, request_ids: Iterable[str], timeout: float = 1.0) -> dict[str, Result]:
        return await self._run(arrivals.wait_any(self.core, request_ids, timeout))

    async def decide(self, request: Submittable, timeout: float | None = 60.0) -> Result:
        return await self._run(self.core.decide(request, timeout))

    async def stats(self) -> dict[str, Any]:
        return await self._run(stats.stats(self.core))

    async def live_workers(self) -> int | None:
        return await self._run(self.core.live_workers())

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _first_contact(self) -> Server:
        where = self.deployment.safe_url
        try:
            probe = self.redis if self._given else aconnect(self.deployment.url, self.deployment.cluster,
                                                            **{**self._options, "retry": AsyncRetry(NoBackoff(), 0)})
            try:
                return await acheck(probe, where)
            finally:
                if probe is not self.redis:
                    await probe.aclose()
        except UNREACHED as error:
            raise _unreachable(where, error) from None

    async def _run(self, plan: Plan[T]) -> T:
        if self.server is None:
            self.server = await self._first_contact()
        plan = served.routing(self, plan)
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(reply)
            except StopIteration as finished:
                return finished.value
            try:
                reply, error = await self._do(step), None
            except Exception as failed:
                reply, error = None, failed

    async def _do(self, step: Step) -> Any:
        try:
            reply = await self._send(step)
        except redis.ResponseError as error:
            if isinstance(step, Pipeline) and step.wait and "replica" in str(error):
                await sentinel.afollow(self.redis)
                raise NotDurable(f"the node that answered is a replica now: {error}", [], 0, step.wait) from None
            raise
        if isinstance(step, (Function, Pipeline)) and step.wait and reply[-1] < step.wait:
            await sentinel.afollow(self.redis)
        return reply

    async def _send(self, step: Step) -> Any:
        if isinstance(step, Function) and step.wait:
            async with self.redis.pipeline(transaction=False) as pipe:
                return await pipe.fcall(step.name, len(step.keys), *step.keys, *step.args).wait(step.wait,
                                                                                                 WAIT_MS).execute()
        if isinstance(step, Function):
            return await self.redis.fcall(step.name, len(step.keys), *step.keys, *step.args)
        if isinstance(step, Load):
            return await library.aensure(self.redis, replace_older=False)
        if isinstance(step, Pipeline):
            async with self.redis.pipeline(transaction=False) as pipe:
                for call in step.calls:
                    getattr(pipe, call.method)(*call.args, **call.kwargs)
                return await pipe.execute()
        return await getattr(self.redis, step.method)(*step.args, **step.kwargs)
