"""The gateway's Redis failures (producer/gateway/front/redis_failures.py): an outage logged once, its end once,
and a call sent during it that times out just after Redis answers again counted in that outage, not a new one."""

from __future__ import annotations

import asyncio
import logging

import redis

from producer.gateway.front import redis_failures
from producer.gateway.metrics import Metrics


def test_an_outage_is_one_warning_even_with_a_timeout_after_it_ended(monkeypatch, caplog):
    monkeypatch.setattr(redis_failures, "PING_EVERY_S", 0.01)
    metrics = Metrics()

    async def answers() -> bool:
        return True

    async def run() -> None:
        failures = redis_failures.RedisFailures(metrics, answers)
        failures.failed(redis.ConnectionError("refused"), "POST /v1/requests")
        failures.failed(redis.ConnectionError("refused"), "POST /v1/requests")
        while failures.down:  # the watch finds Redis answering
            await asyncio.sleep(0.01)
        # a read sent while Redis was frozen times out after it answered again: that outage's
        failures.failed(redis.TimeoutError("Timeout reading from socket"), "GET /v1/results/{request_id}")
        assert failures.down == 0
        failures.failed(redis.ConnectionError("refused"), "POST /v1/requests")  # a new outage: said again
        await failures.close()

    with caplog.at_level(logging.INFO, logger="producer.gateway"):
        asyncio.run(run())
    lines = [record.getMessage() for record in caplog.records]
    assert sum("Redis cannot be reached" in line for line in lines) == 2, lines
    assert sum("answers again after 2 failed calls" in line for line in lines) == 1, lines
    assert metrics.redis_errors.labels("unreachable")._value.get() == 4
