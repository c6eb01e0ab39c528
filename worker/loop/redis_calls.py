"""The worker's Redis calls: one asyncio client, each call retried until Redis answers, and whether it does.

Every stage on the asyncio thread (intake, the lifecycle, the settle loop) calls Redis through ``until``;
``reachable`` is what readiness reports. A Redis outage makes the worker unready and its calls wait; it never
loses work: each call retried here is one that may run twice. While Redis cannot be reached, a warning every
few seconds names the URL (its password left out). The server is checked at first contact (``introduce``),
and before the model loads when it answers then (``first_contact``): an unsupported one ends the worker with
exit 2.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from producer.plumbing.connection import PoolFull, aconnect, connect
from producer.plumbing.logs import Throttled
from producer.plumbing.supported import Server, acheck, check
from producer.wire.errors import NotDurable

from ..config import Settings
from ..metrics import Metrics

log = logging.getLogger("worker")
# Redis trouble, waited out everywhere in the worker (never a refusal, never a fault of the entry in
# hand, never an exit): Redis cannot be reached; or, on Redis Cluster, cannot serve the slot for now. A
# failover answers CLUSTERDOWN and TRYAGAIN, and leaves a slot map without the slot (SlotNotCoveredError,
# a RedisClusterException); a slot being migrated (a reshard) answers ASK for a key moved already and
# TRYAGAIN for a call over several keys of which some moved, and MOVED once it has; the client follows
# those redirections a few times, then gives up with ClusterError "TTL exhausted" (its ASKING may go out
# on another pooled connection than the call it allows, which the importing node then answers MOVED).
# Caught before ResponseError, which CLUSTERDOWN, TRYAGAIN, ASK and MOVED are.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
CLUSTER_TROUBLE = (redis.exceptions.ClusterError, redis.exceptions.TryAgainError, redis.exceptions.AskError,
                   redis.exceptions.RedisClusterException)
REDIS_ERRORS = UNREACHABLE + CLUSTER_TROUBLE


def refusal(reply: object) -> bool:
    """Redis answered, and refused (a ResponseError that is no Redis trouble)."""
    return isinstance(reply, redis.ResponseError) and not isinstance(reply, REDIS_ERRORS)


WARN_EVERY_S = 5.0  # while Redis stays unreachable, one warning this often
REFUSAL_LOG_S = 30.0  # one log line per kind of refused call this often (each one is counted)
REFUSED_READY_S = 5.0  # unready until this long after Redis last refused a call the work waits on
T = TypeVar("T")


class RedisCalls:
    """The loop thread's Redis calls: retried until Redis answers, and whether it does."""

    def __init__(self, client: Any, metrics: Metrics, give_up: Callable[[], bool], where: str) -> None:
        self.redis = client
        self.metrics = metrics
        self.give_up = give_up  # when a call that cannot reach Redis stops retrying (stopping, with nothing to save)
        self.where = where  # the URL without its password
        self.reachable = False
        self.reached = False  # ever: a worker that never reached Redis cannot say what is pending there
        self.server: Server | None = None
        self._down_since: float | None = None
        self._warned = float("-inf")
        self.refused_at: float | None = None  # when Redis last refused a call the work waits on (monotonic)
        self._refusals = Throttled(REFUSAL_LOG_S)  # a line per kind of call this often at most

    async def close(self) -> None:
        await self.redis.aclose()

    def answered(self) -> None:
        if not self.reachable:
            log.info("redis reachable at %s%s", self.where, f" ({self.server})" if self.server else "")
        self.reachable = self.reached = True
        self._down_since = None

    def failed(self, what: str, error: BaseException) -> None:
        now = time.monotonic()
        if isinstance(error, PoolFull):  # the worker's own calls hold every connection: Redis may well answer
            self.metrics.pool_timeouts.inc()
            if now - self._warned >= WARN_EVERY_S:
                self._warned = now
                log.warning("%s (%s); retrying (each one counted in dq_redis_pool_timeouts_total)", error, what)
            return
        self.metrics.redis_errors.labels(what).inc()
        self.reachable = False
        self._down_since = now if self._down_since is None else self._down_since
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            state = "cannot serve the slot for now" if isinstance(error, CLUSTER_TROUBLE) else "unreachable"
            log.warning("redis %s at %s (%s, for %.0f s): %s: %s; retrying", state, self.where, what,
                        now - self._down_since, type(error).__name__, error)

    async def introduce(self) -> Server:
        """The server at first contact (retried until Redis answers); UnsupportedServer if it is too old."""
        self.server = await self.until(lambda: acheck(self.redis, self.where), "connect")
        log.info("redis at %s is %s", self.where, self.server)
        return self.server

    def refused(self, what: str, error: BaseException, stalls: bool = True, detail: str = "") -> None:
        """Redis answered, and refused (out of memory, an ACL, a key of the wrong type, ...): that lasts
        until an operator acts. Counted each time, logged once per ``REFUSAL_LOG_S`` for each kind of call;
        when the work waits on it (``stalls``), the worker is unready until ``REFUSED_READY_S`` after the
        last refusal."""
        self.metrics.redis_errors.labels(what).inc()
        if stalls:
            self.refused_at = time.monotonic()
        if self._refusals.due(what):
            log.error("redis refused %s%s: %s (%s; one line per %.0f s, each one counted in "
                      "dq_redis_errors_total{op=%r})", what, f" ({detail})" if detail else "", error,
                      "retrying" if stalls else "dropped", REFUSAL_LOG_S, what)

    async def reconnect_if_demoted(self, error: BaseException, *clients: Any) -> None:
        """A primary turned replica (READONLY, or a blocked read ended by the change) keeps refusing on these
        connections: where a failover moves an address (a DNS name) rather than a Sentinel's answer, only new
        connections reach the new primary. So every connection of ``clients`` (this one's own by default) is
        closed, and the next call connects again. A Cluster client follows its own topology and is left
        alone."""
        message = str(error)
        if not (isinstance(error, redis.exceptions.ReadOnlyError) or "read only replica" in message
                or ("UNBLOCKED" in message and "replica" in message)):
            return
        for client in clients or (self.redis,):
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                await pool.disconnect()

    @property
    def refusing(self) -> bool:
        """Redis refused a call the work waits on, lately (readiness)."""
        return self.refused_at is not None and time.monotonic() - self.refused_at < REFUSED_READY_S

    async def until(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, retried with a growing pause while Redis cannot be reached or refuses it."""
        delay = 0.1
        while True:
            try:
                result = await call()
            except REDIS_ERRORS as error:
                self.failed(what, error)
                failure: BaseException = error
            except redis.ResponseError as error:  # e.g. OOM under noeviction, NOPERM: retried, never dropped
                if isinstance(error, NotDurable):  # replicas did not confirm: the same, and counted apart
                    self.metrics.not_durable.labels(what).inc()
                self.refused(what, error)
                await self.reconnect_if_demoted(error)
                failure = error
            else:
                self.answered()
                return result
            if self.give_up():
                raise failure
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def first_contact(settings: Settings) -> Server | None:
    """Before the model loads: the server, if it answers at once (raises UnsupportedServer if too old); None
    when it does not (the worker loads its model meanwhile and keeps trying)."""
    client = None
    try:
        client = connect(settings.redis_url, settings.redis_cluster, **settings.redis_options(),
                         retry=Retry(NoBackoff(), 0), socket_connect_timeout=3.0, socket_timeout=3.0)
        return check(client, settings.redis_where)
    except (redis.RedisError, OSError) as error:
        log.warning("redis unreachable at %s: %s; loading the model meanwhile, and retrying", settings.redis_where,
                    error)
        return None
    finally:
        if client is not None:
            client.close()


def client(settings: Settings, retries: int = 1) -> Any:
    """The worker's asyncio client: the producers' connection options, with one quick retry instead of
    redis-py's dozen (about 12 s) before a call fails: ``until`` retries for as long as it takes and says so
    every few seconds, which a call that keeps retrying inside the client would hide. ``retries=0`` for the
    calls whose re-sending would lose what the first one delivered (consumer.py)."""
    return aconnect(settings.redis_url, settings.redis_cluster, **settings.redis_options(),
                    retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), retries))
