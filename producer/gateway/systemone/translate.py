"""The System One wire (what the official clients send and read: typesafe-sdk 0.7.5, the hosted API's schema)
and the queue's: a call's JSON checked and turned into the queue's request, a result into the call's answer,
and a refusal into the body and status the clients map to their exception classes.

- A call is ``{"model", "state", "questions", "assets"?}``: ``state`` text, an object or an array; questions
  ``noul``, ``choice``, ``score`` (``box``: refused 422, no served model has a box head); ``assets`` images,
  inline (``data_base64``) or a multipart part (``part``). Unknown fields are refused 422, naming them, as the
  queue's own requests are. Score levels must be text, objects or arrays: the answer echoes them in
  ``legend``, where the clients refuse anything else.
- The answer is ``{"model", "answers", "usage": {"input_tokens", "output_tokens"}}``: each answer exactly the
  fields its type has (transformers' ``Question.answer``, which the worker computed), ``model`` the name the
  result says answered it (never an alias), one output token per question (one readout each).
- Refusals: 422 as FastAPI's ``{"detail": [{"loc", "msg", "type"}]}`` (``loc`` from ``"body"``), every other
  status as ``{"detail": {"error_type", "message"}}``; the clients read either as the message.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError

from ...wire.keys import MAX_BODY_BYTES
from ...wire.result import Result
from ...wire.schema import IMAGE_FORMATS, MAX_ASSETS, Request
from ..front.replies import Refused
from .decoding import Part

# Every answer's: the queue's request id (a refusal before there is one: its own).
ID_HEADER = "x-typesafe-request-id"
# A question's type in pydantic's locations: not a field the caller wrote.
TAGS = ("noul", "choice", "score", "box")
ANSWERED = {"noul": ("type", "noul"), "choice": ("type", "choice", "confidence", "probabilities"),
            "score": ("type", "score", "confidence", "legend", "probabilities")}
SERVED_TYPES = tuple(ANSWERED)


def _content(value: Any) -> Any:
    if value is not None and not isinstance(value, (str, dict, list)):
        raise ValueError("must be text, a JSON object or an array")
    return value


def _level(value: Any) -> Any:
    if not isinstance(value, (str, dict, list)):
        raise ValueError("a score level must be text, a JSON object or an array (answers echo it in legend)")
    return value


def _state(value: Any) -> Any:
    if not isinstance(value, (str, dict, list)):
        raise ValueError("state must be text, a JSON object or an array")
    return value


Content = Annotated[JsonValue, AfterValidator(_content)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoulCriteria(_Closed):
    """A noul question's two criteria (either may be left out)."""

    true: Content = None
    false: Content = None


class Noul(_Closed):
    """A yes-or-no question."""

    type: Literal["noul"]
    instructions: Content = None
    criteria: NoulCriteria | None = None


class Choice(_Closed):
    """A question with named options, one of which is the answer."""

    type: Literal["choice"]
    instructions: Content = None
    criteria: dict[str, Content] = Field(min_length=1)


class Score(_Closed):
    """A question answered by a level of an ordered scale."""

    type: Literal["score"]
    instructions: Content = None
    criteria: list[Annotated[JsonValue, AfterValidator(_level)]] = Field(min_length=1)


class Box(_Closed):
    """A bounding-box question: refused, no served model has a box head."""

    type: Literal["box"]
    instructions: Content = None


class Asset(_Closed):
    """An image: inline (``data_base64``, ``format``) or the multipart part it names (``part``)."""

    type: Literal["image"] = "image"
    format: str | None = None
    data_base64: str | None = None
    part: str | None = None


class Call(_Closed):
    """The body of a POST /v1/systemone call."""

    model: str = Field(min_length=1)
    state: Annotated[JsonValue, AfterValidator(_state)]
    questions: dict[str, Annotated[Union[Noul, Choice, Score, Box], Field(discriminator="type")]] = Field(
        min_length=1)
    assets: dict[str, Asset] | None = Field(default=None, min_length=1, max_length=MAX_ASSETS)


def _field(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """pydantic's location without a question's type tag: ``questions.q.choice.criteria`` is
    ``questions.q.criteria``."""
    if len(loc) > 2 and loc[0] == "questions" and loc[2] in TAGS:
        return loc[:2] + loc[3:]
    return loc


def invalid(errors: list[dict[str, Any]]) -> Refused:
    """A 422 listing pydantic's problems, each at its place in the body."""
    detail = [{"loc": ["body", *_field(tuple(e.get("loc", ())))],
               "msg": str(e.get("msg", ""))[:300], "type": str(e.get("type", "value_error"))} for e in errors[:10]]
    return Refused(422, "invalid_request", "; ".join(f"{'.'.join(map(str, d['loc'][1:])) or 'body'}: {d['msg']}"
                                                     for d in detail), detail=detail)


def parse(text: bytes) -> Call:
    """A call's JSON, checked against the System One schema; 422 naming each problem."""
    try:
        return Call.model_validate_json(text)
    except ValidationError as error:
        raise invalid(error.errors(include_url=False, include_input=False)) from None


def to_request(call: Call, parts: dict[str, Part], model: str) -> Request:
    """The queue's request for ``call``, its images inline; ``parts``: the multipart body's image parts by
    name (each must be claimed by exactly one asset). 422 for a box question, a missing or unclaimed part, or
    what the queue's own limits refuse; 413 when its images make it larger than a queue request may be."""
    for name, question in call.questions.items():
        if question.type not in SERVED_TYPES:
            raise invalid([{"loc": ("questions", name, "type"), "type": "unsupported_question",
                            "msg": f"{question.type} questions are not served: no model here has a {question.type} "
                                   f"head ({model} answers {', '.join(SERVED_TYPES)})"}])
    assets: dict[str, dict[str, Any]] = {}
    claimed: set[str] = set()
    for key, asset in (call.assets or {}).items():
        where = ("assets", key)
        if asset.part is not None:
            if asset.part not in parts or asset.part in claimed:
                raise invalid([{"loc": (*where, "part"), "type": "value_error", "msg": f"part {asset.part[:80]!r} "
                                + ("is claimed twice" if asset.part in claimed else "is not in the body")}])
            claimed.add(asset.part)
            assets[key] = {"type": "image", "data_base64": base64.b64encode(parts[asset.part].data).decode()}
        elif asset.data_base64 is not None:
            assets[key] = {"type": "image", "data_base64": asset.data_base64}
            if asset.format is not None:
                assets[key]["format"] = asset.format
        else:
            raise invalid([{"loc": where, "type": "missing", "msg": "an image needs data_base64 (and format) or a "
                                                                    "part"}])
        if asset.format is not None and asset.format.lower() not in IMAGE_FORMATS:
            raise invalid([{"loc": (*where, "format"), "type": "value_error",
                            "msg": f"format must be one of {', '.join(IMAGE_FORMATS)}"}])
    if unclaimed := sorted(set(parts) - claimed):
        raise invalid([{"loc": ("assets",), "type": "value_error",
                        "msg": f"parts claimed by no asset: {', '.join(p[:40] for p in unclaimed[:5])}"}])
    size = sum(len(a["data_base64"]) for a in assets.values())
    if size > MAX_BODY_BYTES:
        raise Refused(413, "too_large",
                      f"the images are {size} bytes in base64, over a request's {MAX_BODY_BYTES}")
    body = {"state": call.state, "questions": {n: q.model_dump(exclude_unset=True) for n, q in call.questions.items()},
            **({"assets": assets} if assets else {})}
    try:
        return Request.model_validate(body)
    except ValidationError as error:
        raise invalid(error.errors(include_url=False, include_input=False)) from None


def response(result: Result, model: str) -> bytes:
    """An ok result as the call's answer (``model``: the name results say, if the result lacks one)."""
    answers = {name: {key: answer[key] for key in ANSWERED.get(answer.get("type"), ()) if key in answer}
               for name, answer in (result.answers or {}).items()}
    usage = {"input_tokens": result.usage.tokens if result.usage else 0, "output_tokens": len(answers)}
    return json.dumps({"model": result.model or model, "answers": answers, "usage": usage},
                      separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def error_body(status: int, code: str, message: str, field: str | None = None,
               detail: list[dict[str, Any]] | None = None) -> bytes:
    """A refusal as the System One clients read it: FastAPI's ``detail`` list for 422, else one detail."""
    if status == 422:
        loc = ["body", *(field.split(".") if field and field != "body" else [])]
        body: Any = {"detail": detail or [{"loc": loc, "msg": message, "type": code}]}
    else:
        body = {"detail": {"error_type": code, "message": message}}
    return json.dumps(body, ensure_ascii=False).encode()


def fresh_id() -> str:
    """A refusal's request id before the call has a queue request: its own, for the logs and the client's error."""
    return f"req_{uuid.uuid4().hex}"


def reshaped(status: int, raw: bytes) -> bytes:
    """The gateway's own error body (``{"id", "status", "error": {"code", "message", "field"?}}``, replies.py)
    in the System One shape."""
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    return error_body(status, str(error.get("code", "error")), str(error.get("message", raw[:200].decode(
        "utf-8", "replace"))), error.get("field"))
