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
may: functions persist in RDB/AOF and replicate, but a server restarted empty has none.
producer/plumbing/library_loader.py loads the library when it is missing, and replaces an older revision when
asked. The library name carries the protocol version: a v2 loads beside v1 during a rolling upgrade. Within v1 a
new ``REVISION`` keeps every function's arguments and meaning (it may add functions or optional trailing
arguments), so old and new workers share it; the newest revision wins and nothing loads an older one over a newer.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from .errors import LibraryUnavailable  # noqa: F401 - what loading raises where the user may not load it
from .functions import (CANCEL, CODE, DEAD_LETTER, FORGET, LIBRARY, MAX_BATCH, MAX_DEAD_FIELDS,  # noqa: F401
                        OWN_DEAD_FIELDS, PART, PART_AS, PUBLISH, PUBLISH_AS, REPLY, REQUEUE, REVISION,
                        REVISION_FUNCTION, SUBMIT, SUBMIT_STREAMS)


@dataclass(frozen=True)
class Loaded:
    """What loading (``library_loader.ensure``) found and did: the revision now loaded (the lowest over a
    cluster's primaries) and ``present``, ``loaded`` or ``replaced``."""

    revision: int
    action: str


def missing(error: BaseException) -> bool:
    """Whether a Redis error says that a function is not loaded (a server restarted empty, FUNCTION FLUSH)."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()
