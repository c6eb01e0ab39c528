"""The result of a request, as producers read it: ``ok`` with answers, or ``error`` with a code and a message.

Results are open: a field added by a newer worker is kept, not refused (``model_extra``, written out again),
so producers already deployed keep reading results when workers move ahead.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from .errors import DecisionQueueError
from .schema import ErrorCode

# An error result's message: bounded whatever the request (a list of every problem is not).
MAX_ERROR_CHARS = 2000


class _Open(BaseModel):
    """Results and their parts: unknown fields are accepted and kept (``model_extra``), written out again."""

    model_config = ConfigDict(extra="allow", frozen=True)


class ErrorInfo(_Open):
    """An error result's ``error``: its code and message."""

    # A code this version does not know (a newer worker's) stays a plain string.
    code: Annotated[ErrorCode | str, Field(union_mode="left_to_right")]
    message: str


class Usage(_Open):
    """What a request cost: tokens, prompts, parts."""

    tokens: int = 0  # prompt tokens the model read, over all prompts
    prompts: int = 0  # sequences (prompts) the request was rendered into
    parts: int = 1  # parts it was fanned out into across workers
    # Its one prompt was longer than the model reads: its questions were split over several prompts, whose
    # answers can differ slightly from one prompt's (docs/PROTOCOL.md, "Read a result"). Absent (None) when it
    # was not.
    split: bool | None = None


class Timings(_Open):
    """When a request was enqueued, started and finished, and its compute time."""

    enqueued_ms: int | None = None  # from the stream entry id
    started_ms: int | None = None  # first worker picked it up
    finished_ms: int | None = None  # result published
    compute_ms: float | None = None  # forward time of the packs it rode in (summed over parts)


class Result(_Open):
    """The one result of a request: ``ok`` with answers, or ``error`` with a code and a message.

    ``result.ok`` tells which; ``result.raise_for_error()`` turns an error into a ``ResultError`` and returns
    an ok result, so ``client.decide(request).raise_for_error().answers`` reads an answer or raises.
    """

    id: str
    status: Literal["ok", "error"]
    answers: dict[str, dict[str, Any]] | None = None
    logits: dict[str, list[float]] | None = None  # raw head scores per question, in option order
    probabilities: dict[str, list[float]] | None = None  # softmax(logits / temperature), in option order
    options: dict[str, list[str]] | None = None  # the option names, in the order of logits and probabilities
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    model: str | None = None
    metadata: dict[str, JsonValue] | None = None  # the request's, echoed
    traceparent: str | None = None  # the request's, echoed
    digest: str | None = None  # what the request asked (digest.py): a reused id is told apart by it
    replay: bool | None = None  # this is the stored result of an earlier request with the same id and digest

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_for_error(self) -> Result:
        """This result if it is ok; else raises ``ResultError`` with its code and message."""
        if not self.ok:
            raise ResultError(self)
        return self

    @property
    def option_probabilities(self) -> dict[str, dict[str, float]]:
        """Probabilities by question, then by option name: ``result.option_probabilities["tone"]["calm"]``.
        Raises ``ResultError`` for an error result (it has none)."""
        self.raise_for_error()
        options = self.options or {}
        return {name: dict(zip(options.get(name, ()), values))
                for name, values in (self.probabilities or {}).items()}

    def answering(self, digests: str | Collection[str]) -> Result:
        """This result, if it answers a request with one of ``digests`` (its request's and its body's:
        digest.py); else an ``id_conflict`` error: the id was answered before for another request, or its
        result carries no digest (written before digests, or by something other than a worker) and answers no
        request (docs/PROTOCOL.md, "Reusing an id"). An ``id_conflict`` already said so is returned as it
        is."""
        asked = (digests,) if isinstance(digests, str) else tuple(digests)
        if self.digest is not None and self.digest in asked:
            return self
        if self.digest is None and self.error is not None and self.error.code == ErrorCode.ID_CONFLICT:
            return self  # an unreadable result, already answered as one (``unreadable``)
        whose = ("another request" if self.digest is not None
                 else "no known request (a result without a digest)")
        mine = asked[0] if asked else None
        return Result.failure(self.id, ErrorCode.ID_CONFLICT, f"id {self.id} has the result of {whose} (its "
                              f"digest {self.digest}, this one's {mine}); send it under a new id",
                              digest=mine)

    @classmethod
    def failure(cls, request_id: str, code: ErrorCode | str, message: str, **fields: Any) -> Result:
        """An error result; its message cut to ``MAX_ERROR_CHARS`` (it must not grow with the request)."""
        if len(message) > MAX_ERROR_CHARS:
            kept = MAX_ERROR_CHARS - 40  # room for the note
            message = f"{message[:kept]} ... ({len(message) - kept} more characters)"
        return cls(id=request_id, status="error", error=ErrorInfo(code=code, message=message), **fields)


class ResultError(DecisionQueueError):
    """An error result, raised by ``Result.raise_for_error``: ``code``, ``message``, the ``result`` itself."""

    def __init__(self, result: Result) -> None:
        error = result.error or ErrorInfo(code=ErrorCode.INTERNAL, message="error result without details")
        self.result, self.code, self.message = result, error.code, error.message
        code = self.code.value if isinstance(self.code, ErrorCode) else self.code
        super().__init__(f"request {result.id}: {code}: {self.message}")


class Unreadable(ValueError):
    """A result stream's entry that is not a result of its request: no body, not a result, or another id's.
    Written by something other than a worker (a worker credential, or a user without ACLs): it answers no
    request."""


def read_stored(body: bytes | str | None, request_id: str) -> Result:
    """The result stored in ``request_id``'s result stream (its entry's ``body``); raises Unreadable unless it
    is a result of that id. Producers and workers read a stored result through this one check."""
    if body is None:
        raise Unreadable(f"the result stream of request {request_id!r} holds an entry without a body")
    try:
        result = Result.model_validate_json(body)
    except ValidationError as error:
        raise Unreadable(f"the result stream of request {request_id!r} holds no readable result "
                         f"({error.error_count()} problems, first: {error.errors()[0]['msg'][:200]})") from None
    if result.id != request_id:
        raise Unreadable(f"the result stream of request {request_id!r} holds a result for {result.id[:140]!r}")
    return result


def unreadable(request_id: str, error: Unreadable) -> Result:
    """What a reader hands out for an unreadable stored result: an ``id_conflict`` (its id is taken by
    something that answers no request: send the request under a new id), never an answer."""
    return Result.failure(request_id, ErrorCode.ID_CONFLICT, f"{error}: it answers no request; send the request "
                          "under a new id")
