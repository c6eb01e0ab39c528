"""The client's errors: one base class for all, and a Redis that is down is one clear error at first contact,
within the socket timeout (not redis-py's raw ConnectionError after ~14 s of retries meant for a restart)."""

import asyncio
import time

import pytest
import redis

from producer import client as client_module
from producer.client import AsyncClient, Client, DecisionQueueError, RedisUnreachable
from producer.local.ports import free_port
from producer.plumbing.connection import SOCKET_TIMEOUT


def test_every_error_the_client_raises_shares_one_base_and_keeps_its_own():
    raised = {name: getattr(client_module, name) for name in client_module.__all__
              if isinstance(getattr(client_module, name), type)
              and issubclass(getattr(client_module, name), BaseException)}
    assert set(raised) == {"DecisionQueueError", "InvalidRequest", "LibraryUnavailable", "ModelNotServed",
                           "NotDurable", "QueueFull", "RedisUnreachable", "ResultError", "ResultTimeout",
                           "UnsupportedServer", "WrongResult"}
    assert all(issubclass(error, DecisionQueueError) for error in raised.values())
    assert issubclass(raised["InvalidRequest"], ValueError) and issubclass(raised["ResultTimeout"], TimeoutError)
    assert issubclass(RedisUnreachable, redis.ConnectionError)  # code catching redis-py's error still does
    assert issubclass(raised["NotDurable"], redis.ResponseError)  # a refusal: the worker's link retries it


def test_a_redis_that_is_down_is_one_clear_error_within_the_socket_timeout():
    url = f"redis://producer:s3cret@127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(RedisUnreachable) as caught:
        Client(url).stats()
    assert time.monotonic() - start < SOCKET_TIMEOUT
    message = str(caught.value)
    assert message.startswith("Redis at redis://producer:***@127.0.0.1:") and "s3cret" not in message

    async def first_call() -> None:
        async with AsyncClient(url) as client:
            await client.submit({"state": "x", "questions": {"q": {"type": "noul"}}})

    start = time.monotonic()
    with pytest.raises(RedisUnreachable):
        asyncio.run(first_call())
    assert time.monotonic() - start < SOCKET_TIMEOUT
