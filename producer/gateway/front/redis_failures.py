"""The Redis failures the gateway's calls meet, each counted and said once, not a line per call (an outage under
load wrote one for every failed call, and for every hang-up's cancel that failed).

- Redis unreachable (a connection refused or dropped, no answer in time): the first failure is logged with its
  error, every one counted (``dq_gateway_redis_errors_total{kind="unreachable"}``); from then on a PING every
  second on readiness's own connection (never the tenants' pool) finds when Redis answers again, and one line
  says how many calls failed meanwhile. The worker does the same (worker/loop/redis_calls.py: a warning, then
  "redis reachable"), as does the exporter (one line per outage).
- A refusal (out of memory, an ACL, a failover's READONLY, a bug: ``kind="refused"``), a write the replicas did
  not confirm (``not_durable``), a full connection pool (``PoolFull``: the gateway's own calls hold every
  connection, not Redis down; ``dq_gateway_redis_pool_timeouts_total``): a line a minute at most for each,
  saying how many since the last such line, as front/connections.py does for connections closed at a limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import redis

from ...plumbing.connection import SOCKET_TIMEOUT, PoolFull
from ...plumbing.logs import Throttled
from ...wire.errors import NotDurable
from ..metrics import REDIS_ERROR_KINDS

if TYPE_CHECKING:
    from ..metrics import Metrics

log = logging.getLogger("producer.gateway")
UNREACHABLE, REFUSED, NOT_DURABLE = REDIS_ERROR_KINDS
POOL_FULL = "pool_full"  # counted apart, dq_gateway_redis_pool_timeouts_total
LOG_EVERY_S = 60.0  # a refusal, a write not confirmed, a full pool: a line this often at most, for each
PING_EVERY_S = 1.0  # while Redis cannot be reached, asked this often whether it answers again
METRIC = {POOL_FULL: "dq_gateway_redis_pool_timeouts_total"}


def kind_of(error: BaseException) -> str:
    """What a Redis error says: the pool full, a write not confirmed, Redis not reached, else refused."""
    if isinstance(error, PoolFull):
        return POOL_FULL
    if isinstance(error, NotDurable):
        return NOT_DURABLE
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return UNREACHABLE
    return REFUSED


class RedisFailures:
    """Counts and logs the Redis failures of the gateway's calls (``failed``, for each, on the event loop);
    ``ping`` says whether Redis answers (True), asked while it did not."""

    def __init__(self, metrics: Metrics, ping: Callable[[], Awaitable[bool]]) -> None:
        self.metrics, self.ping = metrics, ping
        self.down = 0  # calls failed since Redis was last known to answer (0: it answers)
        self.down_since = 0.0
        self.answered_at = float("-inf")  # when Redis was last found answering again (monotonic)
        self.watch: asyncio.Task[None] | None = None
        self.lines = Throttled(LOG_EVERY_S)  # the other kinds: a line a minute at most for each

    def failed(self, error: BaseException, where: str) -> None:
        """One call failed by ``error`` (``where``: what it was doing): counted; logged if it is the first of
        an outage, or the first of its kind in a minute."""
        kind = kind_of(error)
        if kind == POOL_FULL:
            self.metrics.pool_timeouts.inc()
        else:
            self.metrics.redis_errors.labels(kind).inc()
        if kind == UNREACHABLE:
            self._unreachable(error, where)
        else:
            self._now_and_then(kind, error, where)

    def _unreachable(self, error: BaseException, where: str) -> None:
        if (isinstance(error, (redis.TimeoutError, TimeoutError))
                and time.monotonic() - self.answered_at < SOCKET_TIMEOUT):
            return  # a call sent before Redis answered again, timing out now: that outage's, counted
        self.down += 1
        if self.down > 1:
            return
        self.down_since = time.monotonic()
        log.warning('Redis cannot be reached (%s): %s: %s; each failed call counted in '
                    'dq_gateway_redis_errors_total{kind="unreachable"}, one line when it answers again', where,
                    type(error).__name__, error)
        self.watch = asyncio.ensure_future(self._until_answered())

    async def _until_answered(self) -> None:
        while True:
            await asyncio.sleep(PING_EVERY_S)
            try:
                if await self.ping():
                    break
            except Exception:  # noqa: BLE001 - not an answer: asked again
                continue
        log.info("Redis answers again after %d failed calls in %.0f s", self.down,
                 time.monotonic() - self.down_since)
        self.down, self.answered_at = 0, time.monotonic()

    def _now_and_then(self, kind: str, error: BaseException, where: str) -> None:
        if not (count := self.lines.due(kind)):
            return
        counted = METRIC.get(kind, f'dq_gateway_redis_errors_total{{kind="{kind}"}}')
        log.warning("Redis (%s): %s: %s; %d such failures since the last such line (a line a minute at most: each "
                    "counted in %s)", where, type(error).__name__, error, count, counted)

    async def close(self) -> None:
        """Stop asking whether Redis answers (the gateway is stopping)."""
        if self.watch is not None and not self.watch.done():
            self.watch.cancel()
