"""Python producer: submit System One requests to the queue and wait for their results (sync and asyncio).

Submitting is one Lua call per batch that refuses the whole batch when the request stream already holds more than
``max_unfinished`` entries (workers delete entries once answered, so its length is the unfinished work). Waiting is
a blocking ``XREAD`` on the result streams of up to 256 awaited requests at once (each keeps its one entry until the
TTL: a result published while nobody waited is still there, and can be read again); on Redis Cluster, where one
read cannot span slots, on the oldest one, then a pipelined look at the others.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .keys import GROUP, Keys, shard_of
from .schema import Request, Result, describe

# KEYS[1] request stream; ARGV[1] limit (0: none); ARGV[2..] request bodies. All or nothing.
SUBMIT = """
local limit = tonumber(ARGV[1])
local length = redis.call('XLEN', KEYS[1])
if limit > 0 and length + #ARGV - 1 > limit then
  return redis.error_reply('QUEUEFULL ' .. length .. ' unfinished entries, limit ' .. limit)
end
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'body', ARGV[i]) end
return ids
"""
BATCH = 500  # requests per Lua call: bounds the time Redis spends in one script
BLOCK_MS = 1000  # kept well below the socket timeout, so a blocking read never looks like a dead connection
WINDOW = 256  # result streams one blocking read waits on (any of them landing wakes it)
SOCKET_TIMEOUT = 5.0
# redis-py's default retry (10 jittered retries from 10 ms, capped at 1 s) gives up after about a second of refused
# connections: less than a Redis restart. These ride out ~12 s. A retried call may run twice (lost reply): results
# are published once whatever happens, and a request enqueued twice is answered once (docs/RELIABILITY.md).
RETRIES, RETRY_BASE, RETRY_CAP = 16, 0.05, 1.0
# redis-py reloads a script once on NOSCRIPT; a cache flushed again in between (restarts, failovers, SCRIPT FLUSH
# in a row) raised to the caller. A NOSCRIPT reply means the script did not run: trying again is safe.
NOSCRIPT_TRIES = 5


class QueueFull(RuntimeError):
    """Backpressure: the stream holds more unfinished requests than the producer's limit."""


class InvalidRequest(ValueError):
    """The request fails the wire schema; nothing was sent."""


class ResultTimeout(TimeoutError):
    """No result within the timeout; the request stays queued and its result can be fetched later."""


def _options(retry: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Timeouts that suit blocking reads and a retry that rides out a Redis restart; the caller's options win."""
    # No CLIENT SETINFO on connect: the ACL roles do not grant it (Redis 7.0 lacks it, so an aclfile naming it would
    # not load there), and on 7.2+ and Valkey each refusal would fill the ACL log.
    return {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT, "health_check_interval": 30,
            "retry": retry(ExponentialBackoff(RETRY_CAP, RETRY_BASE), RETRIES), "lib_name": None,
            "lib_version": None, **options}


def connect(url: str, cluster: bool = False, **options: Any) -> Any:
    """A synchronous client (rediss:// URLs give TLS)."""
    return (redis.RedisCluster if cluster else redis.Redis).from_url(url, **_options(Retry, options))


def aconnect(url: str, cluster: bool = False, **options: Any) -> Any:
    """An asyncio client, as ``connect``."""
    return (aioredis.RedisCluster if cluster else aioredis.Redis).from_url(url, **_options(AsyncRetry, options))


def prepare(request: Request | Mapping[str, Any], max_bytes: int = 8 << 20) -> tuple[str, str]:
    """Validate, give an id if it has none, serialize: (id, body)."""
    try:
        parsed = request if isinstance(request, Request) else Request.model_validate(request)
    except ValidationError as error:
        raise InvalidRequest(describe(error)) from None
    if parsed.id is None:
        parsed = parsed.model_copy(update={"id": uuid.uuid4().hex})
    body = parsed.model_dump_json(exclude_none=True)
    if len(body.encode()) > max_bytes:
        raise InvalidRequest(f"request is {len(body.encode())} bytes, over the {max_bytes}-byte limit")
    return parsed.id, body


def parse_result(fields: Mapping[bytes, bytes]) -> Result:
    return Result.model_validate_json(fields[b"body"])


def by_shard(prepared: list[tuple[str, str]], shards: int) -> dict[int, list[str]]:
    """Prepared bodies grouped by the stream shard of their request id, in order within each shard."""
    out: dict[int, list[str]] = {}
    for request_id, body in prepared:
        out.setdefault(shard_of(request_id, shards), []).append(body)
    return out


def _block_ms(deadline: float | None, missing: int, total: int) -> int:
    """How long the next blocking read may wait; raises ResultTimeout once the deadline has passed."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise ResultTimeout(f"{missing} of {total} results not there yet")
    return BLOCK_MS if left is None else max(1, min(BLOCK_MS, int(left * 1000)))


def _landed(reply: Any, window: dict[str, str]) -> dict[str, Result]:
    """Results in an XREAD reply over result streams, by request id."""
    out = {}
    for key, entries in reply or []:
        name = key.decode() if isinstance(key, bytes) else key
        out[window[name]] = parse_result(entries[0][1])
    return out


def _raise_queue_full(error: redis.ResponseError) -> None:
    if str(error).startswith("QUEUEFULL"):
        raise QueueFull(str(error)[len("QUEUEFULL "):]) from None
    raise error


class _Producer:
    """What both clients hold: the connection (made with ``_connect`` unless one is given), names and limits."""

    _connect: Any  # connect or aconnect

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "dq", max_unfinished: int = 100_000,
                 cluster: bool = False, connection: Any = None, shards: int = 1, **options: Any) -> None:
        self.redis = connection or self._connect(url, cluster, **options)
        self.cluster = cluster or isinstance(self.redis, (redis.RedisCluster, aioredis.RedisCluster))
        self.keys = Keys(namespace)
        self.shards = max(1, shards)
        self.max_unfinished = max_unfinished
        self._submit = self.redis.register_script(SUBMIT)


class Client(_Producer):
    """Synchronous producer. ``max_unfinished=0`` disables the backpressure check (per shard). ``shards``: the
    deployment's stream shard count; each request goes to ``shard_of(id)``. ``options``: redis-py connection
    options (e.g. ``ssl_ca_certs``)."""

    _connect = staticmethod(connect)

    def submit(self, request: Request | Mapping[str, Any]) -> str:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[Request | Mapping[str, Any]]) -> list[str]:
        """Send requests in all-or-nothing batches of 500; returns their ids in order."""
        prepared = [prepare(r) for r in requests]
        for shard, bodies in by_shard(prepared, self.shards).items():
            for start in range(0, len(bodies), BATCH):
                self.send(bodies[start: start + BATCH], shard)
        return [request_id for request_id, _ in prepared]

    def send(self, bodies: list[str], shard: int = 0) -> None:
        """Enqueue already prepared bodies (see ``prepare``) on one shard, all or none; raises QueueFull."""
        for attempt in range(NOSCRIPT_TRIES):
            try:
                self._submit(keys=[Keys(self.keys.namespace, shard).requests], args=[self.max_unfinished, *bodies])
                return
            except redis.exceptions.NoScriptError:  # not run: the cache was flushed again after redis-py reloaded it
                if attempt == NOSCRIPT_TRIES - 1:
                    raise
            except redis.ResponseError as error:
                _raise_queue_full(error)

    def fetch(self, request_id: str) -> Result | None:
        """The result if it is there (non-blocking)."""
        reply = self.redis.xrange(self.keys.result(request_id), count=1)
        return parse_result(reply[0][1]) if reply else None

    def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        return self.wait_many([request_id], timeout)[request_id]

    def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0) -> dict[str, Result]:
        """Results of all ``request_ids``; raises ResultTimeout naming how many are missing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = list(dict.fromkeys(request_ids))
        done = self._present(waiting)
        while len(done) < len(waiting):
            missing = [r for r in waiting if r not in done]
            block = _block_ms(deadline, len(missing), len(waiting))
            window = {self.keys.result(r): r for r in missing[: 1 if self.cluster else WINDOW]}
            reply = self.redis.xread(dict.fromkeys(window, "0-0"), count=1, block=block)
            done.update(_landed(reply, window))
            if self.cluster and reply:  # one key per read there: when the oldest lands, look at the rest
                done.update(self._present(missing[1:]))
        return {r: done[r] for r in waiting}

    def _present(self, request_ids: list[str]) -> dict[str, Result]:
        """The results already there, in one round trip (one key per command: fine on Redis Cluster too)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.xrange(self.keys.result(request_id), count=1)
            replies = pipe.execute()
        return {r: parse_result(reply[0][1]) for r, reply in zip(request_ids, replies) if reply}

    def decide(self, request: Request | Mapping[str, Any], timeout: float | None = 60.0) -> Result:
        """Submit and wait."""
        return self.wait(self.submit(request), timeout)

    def stats(self) -> dict[str, Any]:
        return queue_stats(self.redis, self.keys)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Producer):
    """The asyncio producer, same methods as ``Client``."""

    _connect = staticmethod(aconnect)

    async def submit(self, request: Request | Mapping[str, Any]) -> str:
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: Iterable[Request | Mapping[str, Any]]) -> list[str]:
        prepared = [prepare(r) for r in requests]
        for shard, bodies in by_shard(prepared, self.shards).items():
            for start in range(0, len(bodies), BATCH):
                await self.send(bodies[start: start + BATCH], shard)
        return [request_id for request_id, _ in prepared]

    async def send(self, bodies: list[str], shard: int = 0) -> None:
        """As ``Client.send``."""
        for attempt in range(NOSCRIPT_TRIES):
            try:
                await self._submit(keys=[Keys(self.keys.namespace, shard).requests],
                                   args=[self.max_unfinished, *bodies])
                return
            except redis.exceptions.NoScriptError:  # not run: flushed again after redis-py reloaded it
                if attempt == NOSCRIPT_TRIES - 1:
                    raise
            except redis.ResponseError as error:
                _raise_queue_full(error)

    async def fetch(self, request_id: str) -> Result | None:
        reply = await self.redis.xrange(self.keys.result(request_id), count=1)
        return parse_result(reply[0][1]) if reply else None

    async def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        return (await self.wait_many([request_id], timeout))[request_id]

    async def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0) -> dict[str, Result]:
        """As ``Client.wait_many``: one connection however many results are awaited."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = list(dict.fromkeys(request_ids))
        done = await self._present(waiting)
        while len(done) < len(waiting):
            missing = [r for r in waiting if r not in done]
            block = _block_ms(deadline, len(missing), len(waiting))
            window = {self.keys.result(r): r for r in missing[: 1 if self.cluster else WINDOW]}
            reply = await self.redis.xread(dict.fromkeys(window, "0-0"), count=1, block=block)
            done.update(_landed(reply, window))
            if self.cluster and reply:
                done.update(await self._present(missing[1:]))
        return {r: done[r] for r in waiting}

    async def _present(self, request_ids: list[str]) -> dict[str, Result]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.xrange(self.keys.result(request_id), count=1)
            replies = await pipe.execute()
        return {r: parse_result(reply[0][1]) for r, reply in zip(request_ids, replies) if reply}

    async def decide(self, request: Request | Mapping[str, Any], timeout: float | None = 60.0) -> Result:
        return await self.wait(await self.submit(request), timeout)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def queue_stats(connection: Any, keys: Keys) -> dict[str, Any]:
    """Stream lengths, pending and lag of the worker group, consumers, dead letters, live workers."""
    out: dict[str, Any] = {}
    for name, stream in (("requests", keys.requests), ("chunks", keys.chunks)):
        entry: dict[str, Any] = {"length": connection.xlen(stream)}
        try:
            groups = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
                      for g in connection.xinfo_groups(stream)}
        except redis.ResponseError:  # no such stream yet
            groups = {}
        group = groups.get(GROUP)
        if group:
            entry.update(pending=group["pending"], lag=group.get("lag"), consumers=group["consumers"])
        out[name] = entry
    out["dead_letters"] = connection.xlen(keys.dead)
    out["workers"] = len(connection.hkeys(keys.workers()))
    return out
