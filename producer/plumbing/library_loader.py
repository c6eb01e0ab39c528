"""How the function library (producer/wire/library.py) gets onto a server: ``ensure`` loads it when it is
missing, and replaces an older revision when asked; never a newer one (every role calls it: the worker at
start, a producer when a call finds no function, ``dq-worker load-functions`` as an admin).

The plan reads the loaded revision (on every primary of a cluster) and loads where needed, as commands of the
one shape (commands.py) with no socket; ``ensure`` and ``aensure`` send them on a blocking and an asyncio
client.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import redis

from ..wire.errors import LibraryUnavailable
from ..wire.library import CODE, LIBRARY, REVISION, REVISION_FUNCTION, Loaded, missing
from .commands import Command, asend, send
from .connection import is_cluster


def _plan(replace_older: bool, cluster: bool, again: bool = True) -> Generator[Command, Any, Loaded]:
    """Read the loaded revision (on every primary of a cluster), load or replace if needed."""
    loaded: int | None
    try:
        reply = yield Command(("FCALL", REVISION_FUNCTION, 0), options={"target_nodes": "primaries"} if cluster else {})
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
        yield Command(("FUNCTION LOAD", *(["REPLACE"] if loaded is not None or cluster else []), CODE))
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


def ensure(client: Any, replace_older: bool = True) -> Loaded:
    """Make the library available on the client's server (every primary of a cluster); raises
    LibraryUnavailable when it is missing or older (with ``replace_older``) and the user may not ``FUNCTION
    LOAD``."""
    plan, reply, error = _plan(replace_older, is_cluster(client)), None, None
    while True:
        try:
            command = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = send(client, command), None
        except redis.ResponseError as failed:
            reply, error = None, failed


async def aensure(client: Any, replace_older: bool = True) -> Loaded:
    """``ensure`` for an asyncio client."""
    plan, reply, error = _plan(replace_older, is_cluster(client)), None, None
    while True:
        try:
            command = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = await asend(client, command), None
        except redis.ResponseError as failed:
            reply, error = None, failed
