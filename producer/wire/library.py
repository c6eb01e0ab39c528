"""The queue's server-side code: one Redis Function library, ``dq_v1``, and how it gets onto a server.

Every script the protocol runs inside Redis is in it (its Lua text: producer/wire/functions.py), so that no
role needs ``EVAL``, ``EVALSHA`` or ``SCRIPT``: producers call ``dq_v1_submit`` (admission: the request
stream, each id, each body's size, backpressure, then one ``XADD`` per request, all or nothing), workers
``dq_v1_publish`` and ``dq_v1_part`` (the exactly-once result) and ``dq_v1_forget`` (consumers of workers that
are gone); since revision 2 ``dq_v1_publish_as``, ``dq_v1_part_as`` and ``dq_v1_reply`` (publication that
knows who made it, with its reply), and ``dq_v1_submit`` takes either priority lane's request stream; since
revision 4 ``dq_v1_dead_letter`` (a dead letter, its request's result and its acknowledgement in one step) and
``dq_v1_requeue`` (a dead letter back to its stream, its result first removed, in one step), so that a requeue
never runs between a dead letter and its result, and each request's record (records.py: ``dq_v1_submit``
writes it, ``dq_v1_cancel`` marks it). A leaked credential can call these functions, never run Lua of its own.
Redis checks every command a function runs against its *caller's* ACL user, so a function never gives a caller
more than the caller's user holds.

Loading (``FUNCTION LOAD``) is an admin's act (``dq-worker load-functions``), or the worker's where its user
may: functions persist in RDB/AOF and replicate, but a server restarted empty has none. ``ensure`` loads the
library when it is missing, and replaces an older revision when asked. The library name carries the protocol
version: a v2 loads beside v1 during a rolling upgrade. Within v1 a new ``REVISION`` keeps every function's
arguments and meaning (it may add functions or optional trailing arguments), so old and new workers share it;
the newest revision wins and nothing loads an older one over a newer.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import redis

from .errors import LibraryUnavailable
from .functions import (CANCEL, CODE, DEAD_LETTER, FORGET, LIBRARY, MAX_BATCH, MAX_DEAD_FIELDS,  # noqa: F401
                        OWN_DEAD_FIELDS, PART, PART_AS, PUBLISH, PUBLISH_AS, REPLY, REQUEUE, REVISION,
                        REVISION_FUNCTION, SUBMIT, SUBMIT_STREAMS)


@dataclass(frozen=True)
class Loaded:
    """What ``ensure`` found and did: the revision now loaded (the lowest over a cluster's primaries) and
    ``present``, ``loaded`` or ``replaced``."""

    revision: int
    action: str


def missing(error: BaseException) -> bool:
    """Whether a Redis error says that a function is not loaded (a server restarted empty, FUNCTION FLUSH)."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()


Step = tuple[str, tuple[Any, ...], dict[str, Any]]  # a redis-py method, its arguments and keywords


def _plan(replace_older: bool, cluster: bool, again: bool = True) -> Generator[Step, Any, Loaded]:
    """Read the loaded revision (on every primary of a cluster), load or replace if needed."""
    target = {"target_nodes": "primaries"} if cluster else {}
    loaded: int | None
    try:
        reply = yield "execute_command", ("FCALL", REVISION_FUNCTION, 0), target
        loaded = min(int(value) for value in (reply.values() if isinstance(reply, dict) else [reply]))
    except redis.ResponseError as error:
        if not missing(error):
            raise
        loaded = None  # on one primary at least
    if loaded is not None and (loaded >= REVISION or not replace_older):
        return Loaded(loaded, "present")
    try:
        # REPLACE only over an older revision (or a cluster, where some primaries may have it): two clients
        # that find it missing load it once, the second one's load refused.
        yield "function_load", (CODE,), {"replace": loaded is not None or cluster}
    except redis.exceptions.NoPermissionError:
        raise LibraryUnavailable(
            f"the Redis function library {LIBRARY} (revision {REVISION}) is "
            f"{'missing' if loaded is None else f'at revision {loaded}'} on this server and this user may not "
            f"load it: run `dq-worker load-functions` with an admin's Redis URL") from None
    except redis.ResponseError as error:
        if "already exists" not in str(error) or not again:
            raise
        return (yield from _plan(replace_older, cluster, again=False))  # another client loaded it: look again
    return Loaded(REVISION, "loaded" if loaded is None else "replaced")


def _cluster(client: Any) -> bool:
    import redis.asyncio as aioredis

    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def ensure(client: Any, replace_older: bool = True) -> Loaded:
    """Make the library available on the client's server (every primary of a cluster); raises
    LibraryUnavailable when it is missing or older (with ``replace_older``) and the user may not ``FUNCTION
    LOAD``."""
    plan, reply, error = _plan(replace_older, _cluster(client)), None, None
    while True:
        try:
            method, args, kwargs = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = getattr(client, method)(*args, **kwargs), None
        except redis.ResponseError as failed:
            reply, error = None, failed


async def aensure(client: Any, replace_older: bool = True) -> Loaded:
    """``ensure`` for an asyncio client."""
    plan, reply, error = _plan(replace_older, _cluster(client)), None, None
    while True:
        try:
            method, args, kwargs = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = await getattr(client, method)(*args, **kwargs), None
        except redis.ResponseError as failed:
            reply, error = None, failed
