"""A caller that hangs up: how a route notices, and what it is counted as. Once a call's body is read, the
next ASGI message is the disconnect, so a route that waits (a decide, a long-poll, a cancel on hang-up) awaits
its work with ``unless_gone``: the work is cancelled when the caller goes, its in-flight slots and its Redis
connection come back then, not when the wait would have ended, and the call is answered (and counted) 499,
nginx's status for a caller that closed the connection: nobody reads it. A streamed answer cut short by its
caller counts 499 too (front.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request as HttpRequest
from fastapi.responses import Response

CLIENT_GONE = 499
T = TypeVar("T")


class CallerGone(Exception):
    """The caller hung up while its call waited (answered 499: ``gone``)."""


async def unless_gone(http: HttpRequest, work: Awaitable[T]) -> T:
    """``work``'s outcome (its exception as it is), unless the caller goes first: then ``work`` is cancelled
    and CallerGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done():  # cancelled just now: the caller went first
        raise CallerGone()
    return task.result()


async def _disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def gone(*_: object) -> Response:
    """The answer to a call whose caller went away (an exception handler)."""
    return Response(status_code=CLIENT_GONE)
