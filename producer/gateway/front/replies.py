"""What the gateway answers, and with which HTTP status: a result as it came, or a refusal shaped like an
error result (``{"id", "status": "error", "error": {"code", "message", "field"?}}``), so that a caller reads
one shape.

The status is the error class: 422 invalid input (the code and the field), 413 too large (a batch over the
key's in-flight limit included: it can never be admitted), 409 the id has another request's result
(``id_conflict``), 429 the queue or the caller's in-flight limit is full (``Retry-After``), 504 no result in
time (the id: fetch it later), 503 Redis unreachable or refusing the gateway, or replicas that did not confirm
(``not_durable``), 401/403 the key. Once the gateway knows a request's id (the caller's, or the one it gave),
every answer names it: a Redis error after that point says whether the request may be queued (``Unsettled``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ...plumbing.connection import PoolFull
from ...plumbing.supported import UnsupportedServer
from ...wire.errors import InvalidRequest, LibraryUnavailable, NotDurable, QueueFull
from ...wire.result import Result
from ...wire.schema import ErrorCode
from .disconnects import CallerGone, gone
from .redis_failures import RedisFailures

log = logging.getLogger("producer.gateway")
RETRY_AFTER_S = 1  # a full queue drains at the workers' pace; callers back off from here
JSON = "application/json"
# A worker's error result as an HTTP status: the request's fault (422, 413), time (504), else the service's
# (500).
RESULT_STATUS = {ErrorCode.INVALID_JSON: 422, ErrorCode.INVALID_REQUEST: 422, ErrorCode.INVALID_IMAGE: 422,
                 ErrorCode.STATE_TOO_LONG: 422, ErrorCode.TOO_LARGE: 413, ErrorCode.DEADLINE_EXCEEDED: 504,
                 ErrorCode.ID_CONFLICT: 409, ErrorCode.CANCELLED: 410}
NOT_DURABLE = "not_durable"
# What an Unsettled answer says, by where the call was when Redis failed it.
SUBMIT, WAIT, READ = "submit", "wait", "read"
# The question types are a discriminator, not a field the caller wrote; "one" and "batch" are the body's
# shapes.
NOT_FIELDS = ("body", "query", "path", "noul", "choice", "score", "one", "batch")


class Refused(Exception):
    """A refusal decided by the gateway: raised anywhere in a route, answered by ``refusal``."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None, request_id: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers, self.request_id, self.extra = headers or {}, request_id, extra


class Unsettled(Exception):
    """A Redis error once the gateway knew the ids: ``phase`` says where. ``submit``: the requests may have
    been queued (a command that timed out may have run); ``wait``: they are queued, their results are to be
    fetched later; ``read``: a result could not be read (GET again). ``digests``: the requests' (ids: the same
    order), to read each one's own result with."""

    def __init__(self, error: Exception, ids: list[str], phase: str,
                 digests: list[str] | None = None) -> None:
        super().__init__(str(error))
        self.error, self.ids, self.phase, self.digests = error, ids, phase, digests or []


def error_body(code: str, message: str, request_id: str | None = None, field: str | None = None,
               **extra: Any) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        error["field"] = field
    return json.dumps({"id": request_id, "status": "error", "error": error, **extra}).encode()


def refusal(refused: Refused, request_id: str | None = None) -> Response:
    return Response(error_body(refused.code, refused.message, request_id or refused.request_id, refused.field,
                               **refused.extra), refused.status, refused.headers, media_type=JSON)


def result_status(result: Result) -> int:
    if result.ok:
        return 200
    code = result.error.code if result.error is not None else None
    return RESULT_STATUS.get(code, 500) if isinstance(code, ErrorCode) else 500


def result_response(result: Result) -> Response:
    return Response(result.model_dump_json(exclude_none=True), result_status(result), media_type=JSON)


def field_of(location: tuple[Any, ...] | list[Any]) -> str:
    """``questions.tone.criteria`` for pydantic's location of a problem in the body."""
    return ".".join(str(part)[:80] for part in location if part not in NOT_FIELDS) or "body"


def problems(errors: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(code, field, message) of validation errors: invalid_json when the body is not JSON at all."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid", "type": ""}
    if first.get("type") == "json_invalid":
        why = str((first.get("ctx") or {}).get("error", first.get("msg", "")))[:200]
        return ErrorCode.INVALID_JSON.value, "body", f"the body is not valid JSON: {why}"
    if field_of(first.get("loc", ())) == "body" and first.get("type") in ("model_attributes_type", "dict_type",
                                                                          "model_type"):
        return ErrorCode.INVALID_JSON.value, "body", "the body must be a JSON object, sent as application/json"
    code = ErrorCode.INVALID_REQUEST
    lines = [f"{field_of(e.get('loc', ()))}: {str(e.get('msg', ''))[:300]}" for e in errors[:10]]
    if len(errors) > 10:
        lines.append(f"and {len(errors) - 10} more problems")
    return code.value, field_of(first.get("loc", ())), "; ".join(lines)


def install(app: FastAPI, failures: RedisFailures) -> None:
    """Every exception a route may raise, answered with its status (one place, so routes stay straight); each
    Redis error counted and logged once by ``failures``."""

    async def invalid(_: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        code, field, message = problems(list(error.errors()))
        return refusal(Refused(422, code, message, field))

    async def refused(_: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, Refused)
        return refusal(error)

    async def http(_: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        detail = error.detail if isinstance(error.detail, dict) else {"code": "http_error", "message": error.detail}
        return Response(error_body(str(detail.get("code")), str(detail.get("message"))), error.status_code,
                        getattr(error, "headers", None), media_type=JSON)

    async def invalid_request(_: HttpRequest, error: Exception) -> Response:
        return refusal(Refused(422, ErrorCode.INVALID_REQUEST.value, str(error)))

    async def full(_: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, QueueFull)
        return refusal(Refused(429, "queue_full", f"the queue is full ({error.detail}); retry later",
                               headers={"Retry-After": str(RETRY_AFTER_S)}, accepted=error.accepted,
                               refused=error.refused))

    async def unreachable(http: HttpRequest, error: Exception) -> Response:
        failures.failed(error, _where(http))
        return refusal(_redis_refusal(error))

    async def unsettled(http: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, Unsettled)
        failures.failed(error.error, f"{_where(http)}: {error.phase}")
        refused = _redis_refusal(error.error, error.phase)
        one = error.ids[0] if len(error.ids) == 1 else None
        where = f"/v1/results/{one}" + (f"?digest={error.digests[0]}" if error.digests else "")
        fetch = f"GET {where}" if one else "GET /v1/results/{id}"
        refused.message += {
            SUBMIT: ("" if isinstance(error.error, NotDurable) else "; the request may have been queued") +
            f"; send it again under the same id (a retry of the same request is answered once), or {fetch}",
            WAIT: f"; the request is queued and will be answered: {fetch}",
            READ: f"; {fetch} again"}[error.phase]
        refused.extra["ids"] = error.ids
        if error.digests:
            refused.extra["digests"] = error.digests
        if one:
            refused.headers["Location"] = where
        return refusal(refused, one)

    async def library(_: HttpRequest, error: Exception) -> Response:
        log.error("%s", error)
        return refusal(Refused(503, "unavailable", "the queue's Redis is not set up for it (see the gateway's log)",
                               headers={"Retry-After": str(RETRY_AFTER_S)}))

    for kind, handler in ((RequestValidationError, invalid), (Refused, refused), (HTTPException, http),
                          (InvalidRequest, invalid_request), (QueueFull, full), (redis.RedisError, unreachable),
                          (Unsettled, unsettled), (LibraryUnavailable, library), (UnsupportedServer, library),
                          (CallerGone, gone)):
        app.add_exception_handler(kind, handler)


def _where(http: HttpRequest) -> str:
    """The call's method and route (``GET /v1/results/{request_id}``), never the caller's own path."""
    return f"{http.method} {getattr(http.scope.get('route'), 'path', 'a route')}"


# Refusals that say what state Redis is in (full, a failed save, a replica, loading, a script running, no
# quorum): they pass as an operator or a failover acts, so they are 503 with Retry-After, not the gateway's
# own 500. redis-py turns some into classes (their prefix gone from the message); the others keep their
# prefix.
REDIS_STATES = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                redis.exceptions.BusyLoadingError, redis.exceptions.MasterDownError,
                redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
REDIS_STATE_PREFIXES = {"MISCONF", "BUSY", "NOREPLICAS", "OOM"}


def _redis_refusal(error: Exception, phase: str = SUBMIT) -> Refused:
    """A Redis error's status: 503 unreachable or refusing the gateway (its user's rights, its password), 503
    ``not_durable`` when fewer replicas than asked confirmed, 500 another refused command (a bug: see the
    log)."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, NotDurable):
        if phase == SUBMIT:
            return Refused(503, NOT_DURABLE, f"enqueued on the primary, but {error.replicas} of {error.wanted} "
                           "replicas confirmed it: it may not survive a failover", headers=retry)
        return Refused(503, NOT_DURABLE, f"its result is on the primary, but {error.replicas} of {error.wanted} "
                       "replicas confirmed it: not returned until they do", headers=retry)
    if isinstance(error, REDIS_STATES) or (isinstance(error, redis.ResponseError)
                                           and str(error).split(" ", 1)[0] in REDIS_STATE_PREFIXES):
        return Refused(503, "unavailable", f"the queue's Redis refuses for now ({type(error).__name__}: "
                       f"{str(error)[:200]})", headers=retry)
    if isinstance(error, redis.ResponseError) and not isinstance(error, (redis.exceptions.NoPermissionError,
                                                                      redis.AuthenticationError)):
        return Refused(500, ErrorCode.INTERNAL.value, "Redis refused a command; see the gateway's log")
    if isinstance(error, PoolFull):  # the gateway's own calls hold every connection: Redis may well answer
        return Refused(503, "unavailable", f"the gateway is too busy: all {error.size} of its Redis connections "
                       f"stayed in use for {error.waited:g} s", headers=retry)
    return Refused(503, "unavailable", f"the queue is unavailable: {type(error).__name__}", headers=retry)
