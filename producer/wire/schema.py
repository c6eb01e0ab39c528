"""The wire format shared by producers and workers: a System One request and the error codes of its result
(the result itself: result.py).

A request is ``{"state": ..., "questions": {name: question}, "assets": {...}}`` plus queue fields (``id``,
``reply_to``, ``deadline_ms``, ``priority``) and caller context echoed in its result (``metadata``,
``traceparent``). Validation errors name the field and the problem, so a producer can fix its input from the
error result alone.

Requests are strict (an unknown field is a mistake worth refusing); results are open (result.py).
"""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, JsonValue, SerializationInfo, SerializerFunctionWrapHandler,
                      ValidationError, field_validator, model_serializer, model_validator)

from .keys import REPLY_STREAM, valid_id

# Question content: text, or any JSON (templates print non-strings as JSON).
Content = JsonValue

MAX_QUESTIONS = 64
MAX_OPTIONS = 26
MAX_ASSETS = 16
MAX_NAME_CHARS = 128
MAX_DEPTH = 64  # JSON nesting; templates render nested values recursively (~150 levels exhaust Python's stack)
IMAGE_FORMATS = ("png", "jpeg", "jpg", "webp", "gif", "bmp")
MAX_PROBLEMS = 10  # validation problems named in one message; the rest are counted
MAX_METADATA_BYTES = 4096  # compact UTF-8 JSON; echoed in every result, so kept to what a tag or an id needs
MAX_DEADLINE_MS = 253402300799999  # the last millisecond of the year 9999: any later is a mistake (or an attack)
# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; version ff and all-zero ids are invalid.
TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-[0-9a-f-]+)?")


class ErrorCode(str, enum.Enum):
    """Stable codes of error results; the message says the detail."""

    INVALID_JSON = "invalid_json"  # the entry is not a JSON object
    INVALID_REQUEST = "invalid_request"  # schema or model-specific validation failed
    INVALID_IMAGE = "invalid_image"  # undecodable, unsupported format, or too many pixels
    TOO_LARGE = "too_large"  # the entry exceeds the worker's byte limit
    STATE_TOO_LONG = "state_too_long"  # even one question does not fit the model's maximum length
    DEADLINE_EXCEEDED = "deadline_exceeded"  # expired before compute started
    DEAD_LETTERED = "dead_lettered"  # delivered too often without finishing (a crashing or poison input)
    INTERNAL = "internal_error"  # the worker failed on this input; retried before this result
    ID_CONFLICT = "id_conflict"  # the id was answered before for a different request: nothing computed
    CANCELLED = "cancelled"  # a cancel came before any of its prompts was packed: never computed
    # Written by the producer's command line for its own output, never by a worker:
    TIMEOUT = "timeout"  # no result within the wait; the request stays queued and its result may still come
    NOT_SENT = "not_sent"  # never enqueued: the queue stayed full


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoulQuestion(_Strict):
    """A true/false question: ``{"type": "noul", "instructions": "Is it spam?"}``."""

    type: Literal["noul"]
    instructions: Content = None
    criteria: dict[Literal["true", "false"], Content] | None = None


class ChoiceQuestion(_Strict):
    """One of named options: ``{"type": "choice", "criteria": {"calm": "polite", "angry": null}}``."""

    type: Literal["choice"]
    instructions: Content = None
    criteria: dict[str, Content] = Field(min_length=1, max_length=MAX_OPTIONS)


class ScoreQuestion(_Strict):
    """A level on a scale, lowest first: ``{"type": "score", "criteria": ["low", "mid", "high"]}``."""

    type: Literal["score"]
    instructions: Content = None
    criteria: list[Content] = Field(min_length=1, max_length=MAX_OPTIONS)


Question = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class ImageAsset(_Strict):
    """An image sent inline. Paths and URLs are refused: workers never read files or the network for a producer."""

    type: Literal["image"] = "image"
    format: str | None = None
    data_base64: str = Field(min_length=1)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in IMAGE_FORMATS:
            raise ValueError(f"format must be one of {', '.join(IMAGE_FORMATS)}, got {value!r}")
        return value


class Request(_Strict):
    """A System One request with its queue fields."""

    id: str | None = None
    state: JsonValue
    questions: dict[str, Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    assets: dict[str, ImageAsset] | None = Field(default=None, max_length=MAX_ASSETS)
    reply_to: str | None = None
    # Strict: true is not a deadline (it was read as 1 ms after 1970), nor is 1.5e12.
    deadline_ms: int | None = Field(default=None, ge=0, le=MAX_DEADLINE_MS, strict=True)
    # The lane: producers send it to that lane's stream (absent: normal); a worker refuses one that names the
    # lane of another stream than the one it came from.
    priority: Literal["high", "normal"] | None = None
    metadata: dict[str, JsonValue] | None = None  # opaque to workers, echoed in the result
    traceparent: str | None = None  # W3C trace context: echoed, and in the worker's log lines for the request

    @field_validator("id")
    @classmethod
    def _id_charset(cls, value: str | None) -> str | None:
        if value is not None and not valid_id(value):
            raise ValueError("id must be 1-128 characters of A-Z a-z 0-9 . _ : -, not shaped like a stream entry id "
                             "(digits-digits: those are the ids of requests sent without one)")
        return value

    @model_validator(mode="after")
    def _finite_numbers(self) -> Request:
        """NaN and the infinities are not JSON: Python's and pydantic's parsers take them (and 1e400 as
        infinity), and the body written out again said null, so the model read something else than what was
        sent. Anywhere: the state, the questions' instructions and criteria, the metadata."""
        stack: list[Any] = [self]
        while stack:
            item = stack.pop()
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"numbers must be finite: {item!r} is not a JSON number")
            if isinstance(item, BaseModel):
                stack.extend(item.__dict__.values())
            elif isinstance(item, (dict, list)):
                stack.extend(item.values() if isinstance(item, dict) else item)
        return self

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        size = _metadata_bytes(value) if value else 0
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes of JSON, over the {MAX_METADATA_BYTES}-byte limit")
        return value

    @field_validator("traceparent")
    @classmethod
    def _traceparent_format(cls, value: str | None) -> str | None:
        if value is not None and valid_traceparent(value) is None:
            raise ValueError("traceparent must be a W3C trace context: 00-<32 hex trace id>-<16 hex parent id>-"
                             "<2 hex flags>, lowercase, ids not all zeros")
        return value

    @field_validator("questions")
    @classmethod
    def _question_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if not name or len(name) > MAX_NAME_CHARS:
                raise ValueError(f"question names are 1-{MAX_NAME_CHARS} characters, got {name!r}")
        return value

    @field_validator("assets")
    @classmethod
    def _asset_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in value or {}:
            if len(name) < 3:  # placeholders are searched for in every string of the request
                raise ValueError(f"asset placeholders need at least 3 characters, got {name!r}")
        return value

    @field_validator("reply_to")
    @classmethod
    def _reply_stream(cls, value: str | None) -> str | None:
        # The shape only: a worker also requires its own namespace's prefix (Keys.is_reply_stream).
        if value is not None and not REPLY_STREAM.match(value):
            raise ValueError("reply_to must be a reply stream name: <namespace>:v1:reply: then 1-128 characters of "
                             "A-Z a-z 0-9 . _ : -")
        return value

    @model_serializer(mode="wrap")
    def _null_state_kept(self, write: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """``state`` is required, null included: written out with ``exclude_none`` (how bodies are written), a
        null state was dropped and the worker answered "state: Field required". Kept after ``id``, which stays
        first."""
        data = write(self)
        if info.exclude_none and self.state is None and "state" not in data:
            data = {**({"id": data["id"]} if "id" in data else {}), "state": None, **data}
        return data

    def template_input(self) -> dict[str, Any]:
        """The request as transformers.decision reads it (queue fields dropped, questions as plain dicts)."""
        body: dict[str, Any] = {
            "state": self.state,
            "questions": {name: q.model_dump(exclude_none=True) for name, q in self.questions.items()},
        }
        return body


def _metadata_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def valid_traceparent(value: Any) -> str | None:
    """``value`` if it is a W3C traceparent (version 00 has exactly four fields), else None."""
    if isinstance(value, str) and TRACEPARENT.fullmatch(value) and (value[:2] != "00" or len(value) == 55):
        return value
    return None


def valid_metadata(value: Any) -> dict[str, Any] | None:
    """``value`` if it is request metadata (a JSON object within the cap), else None. For parsed JSON: the
    worker echoes a request's valid metadata even in the error result of an otherwise bad request."""
    try:
        return value if isinstance(value, dict) and _metadata_bytes(value) <= MAX_METADATA_BYTES else None
    except (TypeError, ValueError, RecursionError):  # lone surrogates, values JSON cannot hold
        return None


def describe(error: ValidationError) -> str:
    """One line per problem, each naming where it is (``questions.tone.criteria: ...``); the first
    ``MAX_PROBLEMS``, then how many more."""
    lines = []
    for item in error.errors(include_url=False)[:MAX_PROBLEMS]:
        loc = [str(part)[:80] for part in item["loc"] if part not in ("noul", "choice", "score")]
        lines.append(f"{'.'.join(loc) or 'request'}: {item['msg'][:300]}")
    if error.error_count() > MAX_PROBLEMS:
        lines.append(f"and {error.error_count() - MAX_PROBLEMS} more problems")
    return "; ".join(lines)


def parse_request(raw: str | bytes) -> Request:
    """Parse a request entry body; raises ``RequestError`` with a code and a message naming the problem."""
    return validate(load_json(raw))


def load_json(raw: str | bytes) -> dict[str, Any]:
    """A request body's JSON object, parsed once; raises ``RequestError`` (``invalid_json``) if it is not one."""
    try:
        data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)  # UTF-8 only (json.loads would guess)
    except RecursionError:  # not a ValueError: it would escape as a worker failure, retried, then dead-lettered
        raise RequestError(ErrorCode.INVALID_JSON, "body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(ErrorCode.INVALID_JSON, f"body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RequestError(ErrorCode.INVALID_JSON, f"body must be a JSON object, got {type(data).__name__}")
    return data


def validate(data: dict[str, Any]) -> Request:
    """A parsed request body checked against the schema; raises ``RequestError`` naming the problem."""
    if _depth(data) > MAX_DEPTH:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"the request is nested deeper than {MAX_DEPTH} levels")
    try:  # JSON escapes can carry lone surrogates, which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"text is not valid unicode: {error.reason}") from None
    try:
        return Request.model_validate(data)
    except ValidationError as error:
        raise RequestError(ErrorCode.INVALID_REQUEST, describe(error)) from None


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (the point is to refuse what would exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return deepest


class RequestError(Exception):
    """Bad input: answered at once with an error result, never retried."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
