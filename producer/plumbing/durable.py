"""Durable mode, one executor for every role (docs/RELIABILITY.md, "Durable mode"): a batch of commands sent
so that each counts only once the replicas asked for have it. The client's runner and the worker's publisher
send their durable batches here; what a shortfall means (which ids to name, whether to send again) stays
theirs.

WAIT counts the writes of its own connection, so a batch goes in one pipeline with its WAIT. On one Redis (a
plain server, or the primary Sentinel names) the whole batch ends ``WAIT replicas WAIT_MS``, and reads are
confirmed by a replicated write after them, an empty PUBLISH (``Keys.durable``). On Redis Cluster one
pipeline and WAIT per primary, reads confirmed by a mark in each primary's slot (cluster_wait.py). The answer
is a ``cluster_wait.Confirmed`` either way: each command's reply (a refusal as its error, never raised here)
and the replicas that confirmed it. Fewer than asked: the idle connections are dropped first, so that the
next call asks the sentinels again (a primary they replaced keeps answering for seconds).

The core (``pipeline``, ``confirmed``, ``short``; cluster_wait's ``plan`` and ``settle``) sends nothing;
``run`` and ``arun`` are its blocking and asyncio faces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire.keys import Keys
from . import cluster_wait, sentinel
from .cluster_wait import ATTEMPTS, Confirmed
from .commands import Command, Pipeline, apipelined, pipelined, wait
from .connection import WAIT_MS, is_cluster


@dataclass(frozen=True)
class Durable:
    """A batch sent in durable mode: ``commands``, each confirmed by ``replicas`` replicas within ``WAIT_MS``.
    ``marks``: the commands read, and are confirmed by a replicated write after them (named by these keys)."""

    commands: list[Command]
    replicas: int
    marks: Keys | None = None


def pipeline(batch: Durable) -> list[Command]:
    """What one Redis is sent: the batch, the read mark where it reads, the WAIT."""
    mark = [Command(("PUBLISH", batch.marks.durable(), ""))] if batch.marks is not None else []
    return [*batch.commands, *mark, wait(batch.replicas, WAIT_MS)]


def confirmed(batch: Durable, replies: list[Any]) -> Confirmed:
    """What one Redis answered ``pipeline(batch)``: each command's reply, and the WAIT's count for those that
    went through. A refused WAIT or read mark raises the first refusal of the pipeline, as a pipeline that
    raises would: a demoted primary refuses a write READONLY before it refuses the WAIT, and READONLY is what
    callers read as Redis' state (the gateway's 503, the worker's reconnection)."""
    *answers, count = replies
    mark = answers.pop() if batch.marks is not None else None
    if isinstance(mark, BaseException) or isinstance(count, BaseException):
        raise next(reply for reply in (*answers, mark, count) if isinstance(reply, BaseException))
    return Confirmed(answers, [0 if isinstance(answer, BaseException) else int(count) for answer in answers])


def short(batch: Durable, sent: Confirmed) -> bool:
    """Fewer replicas than asked confirmed a command that went through."""
    fewest = sent.fewest()
    return fewest is not None and fewest < batch.replicas


def run(client: Any, batch: Durable, attempts: int = ATTEMPTS) -> Confirmed:
    """Send ``batch`` in durable mode on a blocking client; on Redis Cluster a doubt (a redirect, a broken
    connection) sends the whole batch again, ``attempts`` times at most (cluster_wait.run)."""
    if is_cluster(client):
        sent = cluster_wait.run(client, batch.commands, batch.replicas, WAIT_MS, batch.marks, attempts)
    else:
        sent = confirmed(batch, pipelined(client, Pipeline(pipeline(batch), raising=False)))
    if short(batch, sent):
        sentinel.follow(client)
    return sent


async def arun(client: Any, batch: Durable, once: Any = None, attempts: int = ATTEMPTS) -> Confirmed:
    """``run`` on an asyncio client; on Redis Cluster through ``once``, a cluster client that never retries a
    command by itself (``cluster_wait.once``: its retry would send again only the commands not answered)."""
    if is_cluster(client):
        sent = await cluster_wait.arun(once, batch.commands, batch.replicas, WAIT_MS, batch.marks, attempts)
    else:
        sent = confirmed(batch, await apipelined(client, Pipeline(pipeline(batch), raising=False)))
    if short(batch, sent):
        await sentinel.afollow(client)
    return sent
