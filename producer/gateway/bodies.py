"""What the POST routes read, and how the OpenAPI description tells it.

The POST routes are plain Starlette routes (routes.py), not FastAPI's: FastAPI's request handling
(dependencies, parameters, a JSON decode before validation) was two fifths of a call's CPU at the gateway's
rates (docs/BENCHMARKS.md). They parse their body in one pass with pydantic's JSON parser, and their query by
hand; a problem raises FastAPI's own ``RequestValidationError``, answered 422 like any other. ``describe``
adds them to FastAPI's OpenAPI description, with the same pydantic schemas.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from ..wire.schema import Request


class Batch(BaseModel):
    """Several requests, each the queue's request JSON."""

    model_config = ConfigDict(extra="forbid")
    requests: list[Request] = Field(min_length=1)


def _shape(value: Any) -> str:
    return "batch" if isinstance(value, (dict, Batch)) and "requests" in value else "one"


Submission = Annotated[Annotated[Request, Tag("one")] | Annotated[Batch, Tag("batch")], Discriminator(_shape)]
ONE, MANY, EITHER = TypeAdapter(Request), TypeAdapter(Batch), TypeAdapter(Submission)
TIMEOUT = "seconds to wait for the results (default: the gateway's --wait-s; at most its --max-wait-s)"


async def parse(http: HttpRequest, adapter: TypeAdapter[Any]) -> Any:
    """The body, parsed and validated in one pass."""
    try:
        return adapter.validate_json(await http.body())
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


def seconds(http: HttpRequest, name: str = "timeout") -> float | None:
    """A query parameter of seconds, above 0 and finite, or None when not given."""
    raw = http.query_params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise RequestValidationError([{"type": "greater_than", "loc": ("query", name),
                                       "msg": "Input should be a number of seconds above 0"}])
    return value


def describe(schema: dict[str, Any], routes: list[tuple[str, str, str, tuple[str, ...], bool]]) -> None:
    """Add the plain routes (path, summary, status, body models, takes ?timeout=) and the bodies' schemas to
    FastAPI's OpenAPI description (their responses: openapi.py)."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (Request, Batch):
        described = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(described.pop("$defs", {}))
        schemas[model.__name__] = described
    for path, summary, status, models, timeout in routes:
        refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
        operation: dict[str, Any] = {
            "summary": summary, "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}},
            "responses": {status: {"description": "the result(s)"}}}
        if timeout:
            operation["parameters"] = [{"name": "timeout", "in": "query", "required": False, "description": TIMEOUT,
                                        "schema": {"type": "number", "exclusiveMinimum": 0}}]
        schema.setdefault("paths", {}).setdefault(path, {})["post"] = operation  # beside its GET, DELETE
