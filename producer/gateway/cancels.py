"""Cancel and status over HTTP, and the cancel a caller's hang-up makes (docs/GATEWAY.md, "Cancel and status").

- ``DELETE /v1/requests/{id}`` cancels one request of the caller's namespace (docs/PROTOCOL.md, "Cancelling"):
  200 ``cancelled``, 202 ``cancelling`` (a worker holds it and decides), 409 ``too_late`` (answered), 404
  ``unknown``, the body saying which. ``GET /v1/requests/{id}`` says where it is (200, 404 ``unknown``).
  ``DELETE`` and ``GET /v1/requests?id=a&id=b`` do the same for up to ``--max-batch`` ids at once: 200,
  ``{"requests": [...]}``.
- A caller of ``/v1/decide`` or ``/v1/decide/batch`` that hangs up before its answers cancels the requests it
  still waited for, unless its key says ``"hang_up": "keep"`` or the call ``?hang_up=keep`` (fire and forget).

Every cancel the gateway makes goes through ``cancel``: counted by reason and what it found
(``dq_gateway_cancels_total``). A System One call's retries map to one request (retries.py): the call
that waits for a request cancelled is answered ``cancelled``; one that comes after the cancel is sent, and
computed, afresh under a new id.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from ..wire.keys import ID_PATTERN
from ..wire.records import Cancel
from ..wire.schema import ErrorCode
from .front.replies import Refused

log = logging.getLogger("producer.gateway")
KEEP, CANCEL = "keep", "cancel"  # what a hang-up does: the key's "hang_up", or the call's ?hang_up=
CANCEL_STATUS = {"cancelled": 200, "cancelling": 202, "too_late": 409, "unknown": 404}
LINE_ID = re.compile(rb'\A\{"id":"([A-Za-z0-9._:\-]{1,128})"')  # a result line's id (written first)
_running: set[asyncio.Task[Any]] = set()  # hang-up cancels in flight (kept from the collector)
Ids = Annotated[list[str], Query(alias="id", description="request ids, each as its own ?id=")]


async def cancel(gateway: Any, namespace: str, ids: list[str], reason: str) -> dict[str, Cancel]:
    """Cancel ``ids`` in ``namespace``; counted by ``reason`` and what each found."""
    found = await gateway.clients[namespace].cancel(ids)
    for answer in found.values():
        gateway.metrics.cancels.labels(reason, answer.state).inc()
    return found


def keeps(http: HttpRequest) -> bool:
    """Whether this call's requests stay queued when its caller hangs up (its key's ``hang_up``, else the
    call's ``?hang_up=``); 422 for any other value than keep or cancel."""
    asked = http.query_params.get("hang_up")
    if asked not in (None, KEEP, CANCEL):
        raise Refused(422, ErrorCode.INVALID_REQUEST.value, f"hang_up is keep or cancel, not {asked[:40]!r}",
                      "hang_up")
    return (asked or http.state.access.hang_up) == KEEP


def hung_up(gateway: Any, http: HttpRequest, ids: list[str]) -> None:
    """The caller went away before these answers: cancel them (unless kept), in a task of its own (the call's
    is ending); a Redis failure is counted and logged once per outage (front/redis_failures.py), another
    logged; never raised at anyone."""
    if not ids:
        return
    access = http.state.access
    if keeps(http):
        gateway.metrics.cancels.labels("hang_up", KEEP).inc(len(ids))
        return

    async def run() -> None:
        try:
            await cancel(gateway, access.namespace, ids, "hang_up")
        except redis.RedisError as error:  # Redis away: the requests are answered as usual, unread
            gateway.failures.failed(error, f"a hang-up's cancel of {len(ids)} requests")
        except Exception as error:  # noqa: BLE001 - never raised at anyone: the call is ending
            log.warning("a hang-up's cancel of %d requests failed: %s: %s", len(ids), type(error).__name__, error)

    task = asyncio.ensure_future(run())
    _running.add(task)
    task.add_done_callback(_running.discard)


async def watched_lines(gateway: Any, http: HttpRequest, lines: AsyncIterator[bytes],
                        ids: list[str]) -> AsyncIterator[bytes]:
    """A streamed batch's lines, as they come; if its caller goes before the last one, the requests without a
    line yet are cancelled (``hung_up``)."""
    left = dict.fromkeys(ids)
    try:
        async for line in lines:
            found = LINE_ID.match(line)
            if found:
                left.pop(found.group(1).decode(), None)
            yield line
        left.clear()
    finally:  # cancelled mid-wait, or closed at a line the caller never took: it went away
        hung_up(gateway, http, list(left))


def install(app: FastAPI, gateway: Any) -> None:
    """The cancel and status routes, by id and for many ids."""
    def checked(http: HttpRequest, ids: list[str]) -> str:
        if not ids or len(ids) > gateway.config.max_batch:
            raise Refused(413 if ids else 422, "batch_too_large" if ids else ErrorCode.INVALID_REQUEST.value,
                          f"1 to {gateway.config.max_batch} ids per call, got {len(ids)}", "id")
        for request_id in ids:
            if not ID_PATTERN.match(request_id):
                raise Refused(422, ErrorCode.INVALID_REQUEST.value,
                              "an id is 1-128 characters of A-Z a-z 0-9 . _ : -", "id")
        return http.state.access.namespace  # its one in-flight slot taken by the front layer (admission.py)

    @app.delete("/v1/requests/{request_id}", summary="Cancel a request: 200 cancelled, 202 cancelling, 409 too late, "
                                                     "404 unknown")
    async def cancel_one(request_id: str, http: HttpRequest) -> Response:
        answer = (await cancel(gateway, checked(http, [request_id]), [request_id], "delete"))[request_id]
        return JSONResponse(answer.model_dump(exclude_none=True), CANCEL_STATUS[answer.state])

    @app.get("/v1/requests/{request_id}", summary="Where a request is: queued, in_progress, answered, cancelled, "
                                                  "dead_lettered; 404 unknown")
    async def status_one(request_id: str, http: HttpRequest) -> Response:
        namespace = checked(http, [request_id])
        answer = (await gateway.clients[namespace].status([request_id]))[request_id]
        return JSONResponse(answer.model_dump(exclude_none=True), 404 if answer.state == "unknown" else 200)

    def each(found: dict[str, Any], ids: list[str]) -> JSONResponse:
        """One entry per id asked, in the order asked: an id asked twice is answered twice (``?id=X&id=X&id=Y``
        gave two entries for three), each id cancelled or looked up once."""
        return JSONResponse({"requests": [found[request_id].model_dump(exclude_none=True) for request_id in ids]})

    @app.delete("/v1/requests", summary="Cancel many requests (?id=a&id=b): an answer per id asked, in order")
    async def cancel_many(http: HttpRequest, ids: Ids) -> Response:
        return each(await cancel(gateway, checked(http, ids), ids, "delete"), ids)

    @app.get("/v1/requests", summary="Where many requests are (?id=a&id=b): an answer per id asked, in order")
    async def status_many(http: HttpRequest, ids: Ids) -> Response:
        return each(await gateway.clients[checked(http, ids)].status(ids), ids)
