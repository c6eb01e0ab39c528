"""What each route answers, in the OpenAPI document (``GET /openapi.json``, ``/docs``, ``/redoc``): every
status a route returns, with the schema of its body, so that a generated client gets types, not ``any``.

Two bodies: a result (``Result``, the queue's result JSON, ok or the worker's error result) and a refusal
decided by the gateway (``Refusal``: the same ``id``, ``status`` and ``error`` fields, plus what some refusals
add). A status that may be either (a worker's ``invalid_request`` result and the gateway's own 422 alike)
declares both. ``tests/redis/test_gateway_openapi.py`` calls every route into each status it declares and
holds the two equal.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..wire.records import Cancel, Status
from ..wire.result import Result
from .systemone.translate import Call


class RefusalError(BaseModel):
    """A refusal's ``error``: a code, a message, the field at fault."""

    code: str = Field(description="what went wrong, a word: unauthorized, invalid_request, queue_full, "
                                  "timeout, ...")
    message: str
    field: str | None = Field(None, description="the field at fault (invalid input)")


class Refusal(BaseModel):
    """An answer the gateway decided itself, shaped like an error result."""

    model_config = ConfigDict(extra="allow")
    id: str | None = Field(description="the request's id, once the gateway knows it")
    status: Literal["error"]
    error: RefusalError
    accepted: list[str] | None = Field(None, description="429 queue_full: the ids that went in")
    refused: list[str] | None = Field(None, description="429 queue_full: the ids that did not")
    ids: list[str] | None = Field(None, description="503 after the ids were known: they may be queued")
    digest: str | None = Field(None, description="504: the request's digest, to read its own result with "
                                                 "(GET /v1/results/{id}?digest=)")
    digests: list[str] | None = Field(None, description="503 after the ids were known: each one's digest")


class Enqueued(BaseModel):
    """POST /v1/requests's 202: the ids and digests, in the order sent."""

    ids: list[str] = Field(description="each request's id, in order (the given one, else the one generated)")
    digests: list[str] = Field(description="each request's digest, in order: GET /v1/results/{id}?digest= "
                                           "answers that request's result only")


class Health(BaseModel):
    """GET /health: the process answers."""

    status: Literal["ok"]


class Info(BaseModel):
    """GET /info: the gateway's release and wire protocol."""

    version: str = Field(description="the gateway's release")
    protocol: str = Field(description="the wire protocol it speaks (docs/PROTOCOL.md)")


class Readiness(BaseModel):
    """GET /ready: whether the gateway can serve, and why not."""

    model_config = ConfigDict(extra="allow")
    ready: bool


class Cancels(BaseModel):
    """DELETE /v1/requests?id=...: what each cancel did."""

    requests: list[Cancel] = Field(description="what each cancel did, in the order asked")


class Statuses(BaseModel):
    """GET /v1/requests?id=...: where each request is."""

    requests: list[Status] = Field(description="where each request is, in the order asked")


class SystemOneUsage(BaseModel):
    """A System One answer's token counts."""

    input_tokens: int = Field(description="the prompt tokens the model read")
    output_tokens: int = Field(description="one per question: one readout each")


class SystemOneAnswer(BaseModel):
    """POST /v1/systemone's 200: the System One API's response (translate.py)."""

    model: str = Field(description="the served name of the model that answered (never an alias)")
    answers: dict[str, dict[str, Any]] = Field(description="question name -> {type, noul} | {type, choice, "
                                                           "confidence, probabilities} | {type, score, "
                                                           "confidence, legend, probabilities}")
    usage: SystemOneUsage


class SystemOneModel(BaseModel):
    """A model a System One call may name (GET /v1/models)."""

    name: str = Field(description="a name a call's model may be: a served name or an alias")
    description: str
    release_date: str = Field(description="empty: the queue does not know a checkpoint's release date")


class SystemOneModels(BaseModel):
    """GET /v1/models: every name a caller may send."""

    models: list[SystemOneModel]


class SystemOneDetail(BaseModel):
    """A System One refusal's detail: the gateway's code and message."""

    error_type: str = Field(description="the gateway's code: unauthorized, model_not_found, queue_full, "
                                        "timeout, ...")
    message: str


class SystemOneRefusal(BaseModel):
    """A System One route's refusal other than 422, as the System One clients read it."""

    detail: SystemOneDetail


class SystemOneProblem(BaseModel):
    """One problem of a System One 422, as FastAPI lists it."""

    loc: list[str | int] = Field(description="where: body, then the field's path")
    msg: str
    type: str


class SystemOneInvalid(BaseModel):
    """A System One route's 422, FastAPI's shape."""

    detail: list[SystemOneProblem]


MODELS = (Result, Refusal, Enqueued, Health, Info, Readiness, Cancel, Status, Cancels, Statuses, Call,
          SystemOneAnswer, SystemOneModels, SystemOneRefusal, SystemOneInvalid)
JSON, NDJSON = "application/json", "application/x-ndjson"


def _ref(*models: type[BaseModel]) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return refs[0] if len(refs) == 1 else {"anyOf": refs}


def body(text: str, *models: type[BaseModel], media: str = JSON) -> dict[str, Any]:
    return {"description": text, "content": {media: {"schema": _ref(*models)}}}


# A gateway without keys answers a loopback Host only, whatever the route (front/layer.py).
HOST = {"400": body("a gateway without keys, called with a Host that is not a loopback name "
                    "(host_not_allowed)", Refusal)}
# Refusals every keyed route may give before its own work (front/layer.py), and a Redis that fails it
# (front/replies.py).
KEYED = {**HOST,
         "401": body("no valid API key, or two Authorization headers (WWW-Authenticate: Bearer)", Refusal),
         "503": body("Redis unreachable or refusing the gateway, or replicas did not confirm (not_durable), "
                     "or the gateway's body budget taken (busy, the body unread): Retry-After; names the ids "
                     "once known", Refusal)}
SUBMITTING = {"403": body("the key may not send to this lane (lane_forbidden)", Refusal),
              "408": body("the body paused longer than --body-timeout-s (body_timeout): the connection "
                          "closed",
                          Refusal),
              "415": body("a gateway without keys, sent a body that is not application/json without an "
                          "Authorization header (unsupported_media_type)", Refusal),
              "413": body("the body or the batch is too large (a batch over the key's in-flight limit: it "
                          "can never be admitted)", Refusal),
              "422": body("invalid input: error.code and error.field say what", Refusal),
              "429": body("the queue is full (queue_full: accepted and refused ids) or the key has too many "
                          "calls in flight: Retry-After", Refusal)}
RESULT_ERRORS = {  # the worker's error results beside the gateway's own refusals
    "409": body("id_conflict: the id has another request's result", Result),
    "413": body("the body or the batch is too large, or the worker's too_large result", Refusal, Result),
    "422": body("invalid input: the gateway's refusal, or the worker's invalid_* result", Refusal, Result),
    "500": body("the worker's internal_error or dead_lettered result", Result),
    "504": body("no result in time (timeout: the id, Location to fetch it later; the message says when no "
                "worker of the namespace is alive), or the worker's deadline_exceeded "
                "result", Refusal, Result)}

# Cancel and status (cancels.py): one slot of the key's while they run, ids checked.
BY_ID = {"422": body("an id that cannot be one", Refusal),
         "429": body("the key has too many calls in flight: Retry-After", Refusal)}
BY_IDS = {**BY_ID, "413": body("more ids than --max-batch in one call (batch_too_large)", Refusal)}
SYSTEM_ONE_REFUSALS = {status: body(text, SystemOneRefusal) for status, text in (
    ("400", "a compressed body that is not what it says, or a gateway without keys called with a Host that "
            "is not a loopback name"),
    ("401", "no valid API key"),
    ("403", "the key may not send to the normal lane"),
    ("404", "no live worker serves the model: the message names the ones served"),
    ("408", "the body paused longer than --body-timeout-s: the connection closed"),
    ("413", "the body, sent or inflated, is over the limit"),
    ("415", "an encoding or media type not taken (a gateway without keys takes other than application/json "
            "only with an Authorization header)"),
    ("429", "the key has too many calls in flight, or the queue is full: Retry-After"),
    ("500", "the worker's internal_error or dead_lettered result"),
    ("503", "Redis unreachable or refusing, or the gateway's body budget taken (busy): Retry-After"),
    ("504", "no result in time (the request stays queued: a retry of the call waits for it)"))}

RESPONSES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/decide"): {**KEYED, **SUBMITTING, **RESULT_ERRORS, "200": body("the result", Result)},
    ("post", "/v1/decide/batch"): {**KEYED, **SUBMITTING, "200": body(
        "one line per request, each id once, as results land: its result, or an error line (timeout, "
        "not_sent, id_conflict, unavailable)", Result, media=NDJSON)},
    ("post", "/v1/requests"): {**KEYED, **SUBMITTING, "202": body(
        "queued: the ids and their digests, to read with GET /v1/results/{id}?digest=", Enqueued)},
    ("get", "/v1/results/{request_id}"): {
        **KEYED, "200": body("the result, ok or the worker's error result", Result),
        "429": body("the key has too many calls in flight (a long-poll holds one): Retry-After", Refusal),
        "404": body("no result for this id (yet): not answered, expired, or another namespace's", Refusal),
        "422": body("an id that cannot be one, or a bad ?wait= or ?digest=", Refusal),
        "409": body("id_conflict: with ?digest=, another request's result under the id; with or without, an "
                    "entry that is no result of it", Result)},
    ("delete", "/v1/requests/{request_id}"): {
        **KEYED, **BY_ID, "200": body("cancelled: not delivered to a worker yet, never computed", Cancel),
        "202": body("cancelling: a worker holds it and decides (answered cancelled unless already packed)",
                    Cancel),
        "409": body("too_late: already answered (status, code)", Cancel),
        "404": body("unknown: no record of the id in the key's namespace", Cancel)},
    ("get", "/v1/requests/{request_id}"): {
        **KEYED, **BY_ID,
        "200": body("where it is: queued, in_progress, answered, cancelled, dead_lettered", Status),
        "404": body("unknown: never sent with this key's namespace, or answered and long expired", Status)},
    ("delete", "/v1/requests"): {**KEYED, **BY_IDS, "200": body("what each cancel did, in order", Cancels)},
    ("get", "/v1/requests"): {**KEYED, **BY_IDS, "200": body("where each is, in order", Statuses)},
    ("get", "/health"): {**HOST, "200": body("the process answers", Health)},
    ("get", "/ready"): {**HOST, "200": body("ready: it can serve (Redis reachable on its own connection, its "
                                            "limits not exhausted)", Readiness),
                        "503": body("not ready: the body says why", Readiness)},
    ("get", "/info"): {**HOST, "200": body("what runs", Info)},
    ("get", "/metrics"): {**HOST, "200": {"description": "Prometheus metrics",
                                          "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ("post", "/v1/systemone"): {
        "200": body("the answers", SystemOneAnswer),
        "422": body("invalid input, each problem at its place (box questions included), or the worker's",
                    SystemOneInvalid),
        **SYSTEM_ONE_REFUSALS},
    ("get", "/v1/models"): {"200": body("every name the key may send", SystemOneModels),
                            "400": body("a gateway without keys, called with a Host that is not a loopback "
                                        "name", SystemOneRefusal),
                            "401": body("no valid API key", SystemOneRefusal),
                            "503": body("Redis unreachable or refusing: Retry-After", SystemOneRefusal)},
}
# The System One routes (systemone/routes.py): plain routes, added to the document here.
SYSTEM_ONE = {
    "/v1/systemone": {"post": {
        "summary": "A System One call (any System One client: typesafe-sdk, ...), routed by model",
        "operationId": "v1_systemone", "parameters": [
            {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "retries under one key are one request (without it: the request's digest)"},
            {"name": "Content-Encoding", "in": "header", "required": False,
             "schema": {"enum": ["zstd", "gzip", "identity"]}}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Call"}},
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["request"], "additionalProperties": {"type": "string",
                                                                                    "format": "binary"},
                "properties": {"request": {"$ref": "#/components/schemas/Call"}}}}}}}},
    "/v1/models": {"get": {"summary": "The models a System One call may name", "operationId": "v1_models"}}}


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """Every route's responses and their schemas, into FastAPI's document (in place; returned)."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in MODELS:
        described = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(described.pop("$defs", {}))
        schemas[model.__name__] = described
    schema.setdefault("paths", {}).update(copy.deepcopy(SYSTEM_ONE))
    for (method, path), responses in RESPONSES.items():
        operation = schema.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["responses"] = dict(sorted(responses.items()))
    schemas.pop("HTTPValidationError", None), schemas.pop("ValidationError", None)  # FastAPI's 422, not ours
    return schema
