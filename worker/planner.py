"""Entry -> task: validate, check size and deadline, render and tokenize (in CPU threads, beside the GPU)."""

from __future__ import annotations

import json
import threading
import time

from producer.keys import ID_PATTERN
from producer.schema import ErrorCode, RequestError, parse_request

from .checkpoint import DecisionModel
from .config import Settings
from .encoder import Encoder
from .tasks import CHUNKS, Delivery, Task


def request_id_of(delivery: Delivery) -> str:
    """The id a result is published under: a part's request, the body's valid ``id``, else the entry id."""
    if delivery.stream == CHUNKS:
        return delivery.fields[b"request_id"].decode()
    try:
        candidate = json.loads(delivery.fields.get(b"body", b"")).get("id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        candidate = None
    if isinstance(candidate, str) and ID_PATTERN.match(candidate):
        return candidate
    return delivery.entry_id


class Planner:
    """Thread-safe: each calling thread gets its own encoder (tokenizers are not shareable across threads)."""

    def __init__(self, model: DecisionModel, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self._local = threading.local()

    def _encoder(self) -> Encoder:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:
            encoder = self._local.encoder = Encoder(self.model, self.settings.max_image_pixels)
        return encoder

    def plan(self, delivery: Delivery, body: bytes | None = None) -> Task:
        """Raises RequestError (answered at once, never retried) for bad input and expired deadlines."""
        raw = body if body is not None else delivery.fields.get(b"body")
        if raw is None:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the entry has no 'body' field")
        if len(raw) > self.settings.max_entry_bytes:
            raise RequestError(ErrorCode.TOO_LARGE,
                               f"the entry is {len(raw)} bytes; this worker takes at most {self.settings.max_entry_bytes}")
        request = parse_request(raw)
        task = Task(delivery=delivery, request_id=request_id_of(delivery), request=request)
        if task.expired:
            late = time.time() * 1000 - (request.deadline_ms or 0)
            raise RequestError(ErrorCode.DEADLINE_EXCEEDED, f"the deadline passed {late:.0f} ms before compute")
        names = None
        if delivery.stream == CHUNKS:
            task.part, task.parts = int(delivery.fields[b"part"]), int(delivery.fields[b"parts"])
            names = json.loads(delivery.fields[b"questions"])
        task.chunks = self._encoder().plan(request, names)
        task.remaining = len(task.chunks)
        return task
