"""The one base of every error the producer raises (``DecisionQueueError``), and the error for a Redis that cannot
be reached at first contact. Each error keeps its other base (``ValueError``, ``TimeoutError``, redis-py's
``ConnectionError``...), so code that caught those still does."""

from __future__ import annotations

import redis


class DecisionQueueError(Exception):
    """Base of every decision-queue error: ``except DecisionQueueError`` catches each one the client raises."""


class RedisUnreachable(DecisionQueueError, redis.ConnectionError):
    """Redis did not answer the first contact (refused, unresolvable, or silent for the socket timeout): raised
    once, without the retries meant for a restarting server, naming the URL (password hidden) and the cause."""
