"""The worker's link to Redis: one asyncio client, calls retried until Redis answers, and whether it does.

Every stage on the asyncio thread (intake, results, the daemon's planning step) calls Redis through ``until``;
``reachable`` is what readiness reports. A Redis outage makes the worker unready and its calls wait; it never loses
work: each call retried here is one that may run twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis

from .metrics import Metrics

log = logging.getLogger("worker")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
REFUSAL_LOG_S = 30.0  # one log line per kind of refused call this often (each one is counted)
REFUSED_READY_S = 5.0  # unready until this long after Redis last refused a call the work waits on
T = TypeVar("T")


class Link:
    def __init__(self, client: Any, metrics: Metrics, give_up: Callable[[], bool]) -> None:
        self.redis = client
        self.metrics = metrics
        self.give_up = give_up  # when a call that cannot reach Redis stops retrying (stopping, past the drain)
        self.reachable = False
        self.refused_at: float | None = None  # when Redis last refused a call the work waits on (monotonic)
        self._refusal_logged: dict[str, float] = {}

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

    def refused(self, what: str, error: BaseException, stalls: bool = True, detail: str = "") -> None:
        """Redis answered, and refused (out of memory, an ACL, a key of the wrong type, ...): that lasts until an
        operator acts. Counted each time, logged once per ``REFUSAL_LOG_S`` for each kind of call; when the work
        waits on it (``stalls``), the worker is unready until ``REFUSED_READY_S`` after the last refusal."""
        self.metrics.redis_errors.labels(what).inc()
        now = time.monotonic()
        if stalls:
            self.refused_at = now
        if now - self._refusal_logged.get(what, float("-inf")) >= REFUSAL_LOG_S:
            self._refusal_logged[what] = now
            log.error("redis refused %s%s: %s (%s; one line per %.0f s, each one counted in "
                      "dq_redis_errors_total{op=%r})", what, f" ({detail})" if detail else "", error,
                      "retrying" if stalls else "dropped", REFUSAL_LOG_S, what)

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
            except redis.exceptions.NoScriptError:  # the script cache was flushed: the call reloads it
                await asyncio.sleep(0.01)
                continue
            except redis.ResponseError as error:  # e.g. OOM under noeviction, NOPERM: retried, never dropped
                self.refused(what, error)
                failure: BaseException = error
            except REDIS_ERRORS as error:
                self.failed(what, error)
                failure = error
            else:
                self.answered()
                return result
            if self.give_up():
                raise failure
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
