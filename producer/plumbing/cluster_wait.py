"""Durable mode on Redis Cluster (durable.py sends through here): each write confirmed by a WAIT on the primary
that took it, on the connection that sent it (docs/RELIABILITY.md, "Durable mode on Redis Cluster").

WAIT counts the writes of its own connection on the node it runs on, and a cluster client routes a keyless
WAIT to every primary and sums their answers, so a plain ``WAIT`` through one "confirms" at once. Here the
calls (commands.py: each knows its key) are grouped by the primary that serves their key's slot, and each
primary's calls go in one pipeline of their own, on one connection of that node, ending with its WAIT. Nothing is redirected or re-sent inside a
pipeline: a write sent again elsewhere after MOVED, or alone on a new connection after a broken one, would not
be covered by the WAIT sent here (on Valkey and Redis 8 a WAIT on a connection that wrote nothing answers at
once with every replica). A call answered MOVED, ASK, TRYAGAIN, CLUSTERDOWN or a connection error is a doubt:
the slot map is refreshed and the whole batch sent again (every write of the queue is idempotent by id),
``attempts`` times at most, then the doubt is raised (a redirect as TRYAGAIN: nothing was written, the slot is
moving).

A read is confirmed by a replicated write after it on the same connection. On a cluster PUBLISH goes over the
cluster bus, not the replication stream (measured: XRANGE, PUBLISH, WAIT 1 answered 1 at once with the only
replica frozen on Valkey 9.1 and Redis 8.2), so ``marks`` asks for a SET of a short-lived key in the read
keys' slot (``Keys.durable_mark``) before each node's WAIT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisClusterException, TryAgainError

from ..wire.keys import Keys
from .commands import Command
from .connection import RETRIES, RETRY_BASE, RETRY_CAP, WAIT_MS, aconnect

# What leaves a call in doubt: it may not have run on the primary its WAIT asks (RedisClusterException: the
# slot map has no node for a key, e.g. while a slot has no primary).
DOUBTS = (MovedError, AskError, TryAgainError, ClusterDownError, redis.ConnectionError, redis.TimeoutError,
          RedisClusterException)
MARK_TTL_MS = 10_000  # a read mark's life: long enough to be replicated, short enough to leave nothing behind
ATTEMPTS = RETRIES + 1  # a client's: through a failover (a new primary in 2-5 s with a 2 s node timeout)


@dataclass(frozen=True)
class Confirmed:
    """Each call's reply (a refusal as its ResponseError, never raised here) and the replicas its primary
    confirmed for it (0 where its reply is an error)."""

    replies: list[Any]
    replicas: list[int]

    def fewest(self) -> int | None:
        """The fewest replicas that confirmed a call that went through; None when none did."""
        counted = [n for n, reply in zip(self.replicas, self.replies) if not isinstance(reply, BaseException)]
        return min(counted) if counted else None


class Batch(NamedTuple):
    """One primary's share of the calls: the node, the calls' indexes, the commands its pipeline sends."""

    node: Any
    indexes: list[int]
    commands: list[tuple[Any, ...]]


def plan(cluster: Any, calls: Sequence[Command], wait: int, wait_ms: int = WAIT_MS, marks: Keys | None = None
         ) -> list[Batch]:
    """The calls grouped by the primary of their key's slot (the client's slot map), each group's pipeline
    ending with a read mark (``marks``) and ``WAIT wait wait_ms``; each pipeline's commands as their words."""
    nodes: dict[str, tuple[Any, list[int]]] = {}
    for index, call in enumerate(calls):
        node = cluster.get_node_from_key(call.key)
        nodes.setdefault(node.name, (node, []))[1].append(index)
    batches = []
    for node, indexes in nodes.values():
        commands = [calls[index].words for index in indexes]
        if marks is not None:
            commands.append(("SET", marks.durable_mark(calls[indexes[0]].key), "", "PX", MARK_TTL_MS))
        batches.append(Batch(node, indexes, [*commands, ("WAIT", wait, wait_ms)]))
    return batches


def settle(size: int, batches: list[Batch], outputs: list[list[Any]], marked: bool
           ) -> tuple[Confirmed, BaseException | None]:
    """What the pipelines answered, per call; and the first doubt, if any (then the whole batch goes again)."""
    replies: list[Any] = [None] * size
    replicas = [0] * size
    doubt: BaseException | None = None
    for batch, output in zip(batches, outputs):
        *answers, confirmed = output
        if marked:  # the read mark is the write the WAIT confirms: its failure leaves every read of the node short
            written = answers.pop()
            if isinstance(written, BaseException):
                confirmed = written
        if isinstance(confirmed, DOUBTS):
            doubt = doubt or confirmed
        for index, answer in zip(batch.indexes, answers):
            replies[index] = answer
            if isinstance(answer, DOUBTS):
                doubt = doubt or answer
            elif not isinstance(answer, BaseException) and isinstance(confirmed, int):
                replicas[index] = confirmed
    return Confirmed(replies, replicas), doubt


def _raised(doubt: BaseException) -> BaseException:
    """The doubt as what callers wait out (workers: as an unreachable Redis): a redirect as TRYAGAIN (the slot
    is moving, nothing was written there; a MOVED would be a refusal to them), a slot map without the slot or
    without a node that answers as CLUSTERDOWN."""
    if isinstance(doubt, (MovedError, AskError)):
        return TryAgainError(f"the slot moved ({doubt}); sent again once the slot map is refreshed")
    if not isinstance(doubt, redis.RedisError):
        return ClusterDownError(f"no primary to send to: {doubt}")
    return doubt


def _pause(failures: int) -> float:
    return ExponentialBackoff(RETRY_CAP, RETRY_BASE).compute(failures)


def run(cluster: redis.RedisCluster, calls: Sequence[Command], wait: int, wait_ms: int = WAIT_MS,
        marks: Keys | None = None, attempts: int = ATTEMPTS) -> Confirmed:
    """Send ``calls`` through a synchronous cluster client: each primary's share in one pipeline on that
    node's own client (which neither retries nor follows redirects), ending with its WAIT."""
    for attempt in range(attempts):
        try:
            batches = plan(cluster, calls, wait, wait_ms, marks)
        except RedisClusterException as error:
            confirmed, doubt = Confirmed([], []), error
        else:
            outputs = []
            for batch in batches:
                pipe = cluster.get_redis_connection(batch.node).pipeline(transaction=False)
                for command in batch.commands:
                    pipe.execute_command(*command)
                try:
                    outputs.append(pipe.execute(raise_on_error=False))
                except DOUBTS as error:
                    outputs.append([error] * len(batch.commands))
            confirmed, doubt = settle(len(calls), batches, outputs, marks is not None)
        if doubt is None:
            return confirmed
        try:  # a new slot map for the next attempt, or the caller's next call
            cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException):
            pass  # no node answered: the next attempt finds out
        if attempt == attempts - 1:
            raise _raised(doubt)
        time.sleep(_pause(attempt))
    raise AssertionError("unreachable")


def once(url: str, options: dict[str, Any]) -> Any:
    """An asyncio cluster client that never retries a command by itself, for ``arun``."""
    return aconnect(url, True, **{**options, "retry": AsyncRetry(NoBackoff(), 0)})


async def arun(cluster: Any, calls: Sequence[Command], wait: int, wait_ms: int = WAIT_MS, marks: Keys | None = None,
               attempts: int = ATTEMPTS) -> Confirmed:
    """``run`` for an asyncio cluster client, which must not retry by itself (a ``retry`` of 0 retries): its
    pipeline sends each node's commands on one connection, but a retry would send again only the commands not
    answered, maybe the WAIT alone."""
    for attempt in range(attempts):
        try:
            await cluster.initialize()  # the first time (later: at once, unless a refresh was asked for)
            batches = plan(cluster, calls, wait, wait_ms, marks)
        except (redis.RedisError, RedisClusterException) as error:
            confirmed, doubt = Confirmed([], []), error
        else:
            async with cluster.pipeline(transaction=False) as pipe:
                for batch in batches:
                    for command in batch.commands:
                        pipe.execute_command(*command, target_nodes=batch.node)
                try:
                    flat = await pipe.execute(raise_on_error=False, allow_redirections=False)
                except DOUBTS as error:
                    flat = [error] * sum(len(batch.commands) for batch in batches)
            outputs, at = [], 0
            for batch in batches:
                outputs.append(flat[at: at + len(batch.commands)])
                at += len(batch.commands)
            confirmed, doubt = settle(len(calls), batches, outputs, marks is not None)
        if doubt is None:
            return confirmed
        try:
            await cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException):
            pass
        if attempt == attempts - 1:
            raise _raised(doubt)
        await asyncio.sleep(_pause(attempt))
    raise AssertionError("unreachable")
