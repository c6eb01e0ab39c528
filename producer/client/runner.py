"""How the client's two faces run a plan (producer/client/plans.py) on their connection: each step sent, its
reply or its error handed back to the plan, the plan routed to its model's namespace first (served.py); the
first call asks the server what it is. The plans are the logic, written once; this is the I/O, written for
each face (``Blocking``, ``Asynchronous``), and the constructor both share (``Face``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..plumbing import cluster_wait, durable, library_loader, sentinel
from ..plumbing.commands import apipelined, asend, pipelined, send
from ..plumbing.connection import Deployment, aconnect, connect, is_cluster
from ..plumbing.durable import Durable
from ..plumbing.supported import Server, acheck, check
from ..wire.errors import NotDurable, RedisUnreachable
from ..wire.keys import Keys
from . import control, served
from .plans import NO_WORKER_S, Load, Pipeline, Plan, Producer, Step

T = TypeVar("T")
# What a first contact that never reached a server raises (RedisClusterException: no node of a cluster
# answered).
UNREACHED = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException)


def _demoted(step: Step, error: redis.ResponseError) -> NotDurable | None:
    """A durable read's "WAIT cannot be used with replica instances": the node was a primary, demoted since
    (each face then asks the sentinels for the promoted one). (A durable write's is raised as it is.)"""
    if isinstance(step, Durable) and step.marks is not None and "replica" in str(error):
        return NotDurable(f"the node that answered is a replica now: {error}", [], 0, step.replicas)
    return None


def _unreachable(where: str, error: BaseException) -> RedisUnreachable:
    return RedisUnreachable(f"Redis at {where} cannot be reached: {error}")


class Face:
    """What both faces hold: the connection (made from the deployment unless one is given) and the core.

    Arguments left out come from the worker's ``DQ_*`` variables (``DQ_REDIS_URL``, ``DQ_NAMESPACE``,
    ``DQ_REDIS_CLUSTER``, ``DQ_REDIS_TLS_*``) and ``DQ_SHARDS``, then the defaults. ``max_unfinished``: the
    backpressure limit per shard (0: none). ``wait_replicas`` (``DQ_WAIT_REPLICAS``): durable mode, an enqueue
    is acknowledged and a result returned only once that many replicas have it, else NotDurable names the ids.
    ``no_worker_s``: a wait (``wait``, ``wait_many``, ``decide``) during which no worker of the namespace is
    alive ends after this many seconds, not its whole timeout, with a ResultTimeout that says "no live worker
    in namespace X" (``no_worker``); None: the whole timeout. ``model``: the first of ``model_namespaces``
    whose live workers serve it, or ModelNotServed (producer/client/served.py). ``options``: redis-py
    connection options (``ssl_ca_certs``).

    The first call asks the server what it is, once and without retries: a Redis that is down raises
    ``RedisUnreachable`` within the socket timeout (5 s), not after the retries that ride out a restart.
    """

    _connect: Any  # connect or aconnect
    server: Server | None = None  # what the server said at first contact (producer/plumbing/supported.py)
    routed: served.ServedModel | None = None  # where ``model`` is served, once found

    def __init__(self, url: str | None = None, namespace: str | None = None, max_unfinished: int = 100_000,
                 cluster: bool | None = None, connection: Any = None, shards: int | None = None,
                 wait_replicas: int | None = None, no_worker_s: float | None = NO_WORKER_S,
                 model: str | None = None, model_namespaces: Iterable[str] | None = None, **options: Any) -> None:
        deployment = self.deployment = Deployment.resolve(url=url, namespace=namespace, cluster=cluster,
                                                          shards=shards, wait_replicas=wait_replicas)
        self.model, self.model_namespaces = model, list(model_namespaces or [deployment.namespace])
        self._options = {**deployment.options(), **options}
        self._given = connection is not None
        try:  # a cluster client connects here already
            self.redis = connection or self._connect(deployment.url, deployment.cluster, **self._options)
        except UNREACHED as error:
            raise _unreachable(deployment.safe_url, error) from None
        cluster = deployment.cluster or is_cluster(self.redis)
        self.keys = Keys(deployment.namespace)
        self.core = Producer(self.keys, deployment.shards, max_unfinished, cluster, deployment.wait_replicas,
                             no_worker_s)
        self.shards, self.max_unfinished = self.core.shards, self.core.max_unfinished  # as the core has them

    # Both faces' (``AsyncClient``: awaited), each the plan of control.py run on the face's connection.
    def cancel(self, request_ids: Iterable[str] | str) -> Any:
        """Cancel requests (docs/PROTOCOL.md, "Cancelling"): by id, what each cancel did (``Cancel``)."""
        return self._run(control.cancel(self.core, request_ids))  # type: ignore[attr-defined]

    def status(self, request_ids: Iterable[str] | str) -> Any:
        """Where requests are (docs/PROTOCOL.md, "Status"), by id (``Status``); two round trips, no payload."""
        return self._run(control.status(self.core, request_ids))  # type: ignore[attr-defined]


class Blocking(Face):
    """Runs plans on a blocking connection."""

    _connect = staticmethod(connect)

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
            return self._send(step)
        except redis.ResponseError as error:
            if (demoted := _demoted(step, error)) is not None:
                sentinel.follow(self.redis)
                raise demoted from None
            raise

    def _send(self, step: Step) -> Any:
        if isinstance(step, Durable):  # one executor with the worker's (producer/plumbing/durable.py)
            return durable.run(self.redis, step)
        if isinstance(step, Load):  # only when missing: a producer never replaces the workers' revision
            return library_loader.ensure(self.redis, replace_older=False)
        if isinstance(step, Pipeline):
            return pipelined(self.redis, step)
        return send(self.redis, step)


class Asynchronous(Face):
    """Runs plans on an asyncio connection."""

    _connect = staticmethod(aconnect)
    _once: Any = None  # durable mode on Redis Cluster: a client that never retries (cluster_wait.arun)

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
            return await self._send(step)
        except redis.ResponseError as error:
            if (demoted := _demoted(step, error)) is not None:
                await sentinel.afollow(self.redis)
                raise demoted from None
            raise

    async def _send(self, step: Step) -> Any:
        if isinstance(step, Durable):
            if isinstance(self.redis, aioredis.RedisCluster):  # on a client of its own that never re-sends by itself
                self._once = self._once or cluster_wait.once(self.deployment.url, self._options)
            return await durable.arun(self.redis, step, self._once)
        if isinstance(step, Load):
            return await library_loader.aensure(self.redis, replace_older=False)
        if isinstance(step, Pipeline):
            return await apipelined(self.redis, step)
        return await asend(self.redis, step)
