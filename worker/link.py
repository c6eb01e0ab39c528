"""The worker's link to Redis: one asyncio client, calls retried until Redis answers, and whether it does.

Every stage on the asyncio thread (intake, results, the daemon's planning step) calls Redis through ``until``;
``reachable`` is what readiness reports. A Redis outage makes the worker unready and its calls wait; it never loses
work: each call retried here is one that may run twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis

from .metrics import Metrics

log = logging.getLogger("worker")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
T = TypeVar("T")


class Link:
    def __init__(self, client: Any, metrics: Metrics, give_up: Callable[[], bool]) -> None:
        self.redis = client
        self.metrics = metrics
        self.give_up = give_up  # when a call that cannot reach Redis stops retrying (stopping, past the drain)
        self.reachable = False

    async def close(self) -> None:
        await self.redis.aclose()

    def answered(self) -> None:
        if not self.reachable:
            log.info("redis reachable")
        self.reachable = True

    def failed(self, what: str, error: BaseException) -> None:
        self.metrics.redis_errors.labels(what).inc()
        if self.reachable:
            log.warning("redis unreachable (%s): %s; retrying", what, error)
        self.reachable = False

    async def until(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, retried with a growing pause while Redis cannot be reached."""
        delay = 0.1
        while True:
            try:
                result = await call()
            except REDIS_ERRORS as error:
                self.failed(what, error)
                if self.give_up():
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.answered()
            return result
