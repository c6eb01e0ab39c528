"""Entry -> task: validate, check size and deadline, render and tokenize, beside the GPU.

Planning is mostly Python (templates, validation): in threads it competes with the GPU thread for the GIL, so a
busy GPU worker plans in separate processes (``--planner-processes``), each with its own encoder built from the
checkpoint's render spec (tokenizer, template; no weights). Threads suit CPU runs and small deployments.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from producer.keys import ID_PATTERN
from producer.schema import ErrorCode, Request, RequestError, parse_request

from .config import Settings
from .model.checkpoint import DecisionModel, RenderSpec
from .model.encoder import Encoder
from .model.engine import Chunk
from .tasks import CHUNKS, Delivery, Task


def request_id_of(delivery: Delivery) -> str:
    """The id a result is published under: a part's request, the body's valid ``id``, else the entry id."""
    if delivery.stream == CHUNKS:
        return delivery.fields[b"request_id"].decode()
    try:
        candidate = json.loads(delivery.fields.get(b"body", b"")).get("id")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):  # any body at all
        candidate = None
    if isinstance(candidate, str) and ID_PATTERN.match(candidate):
        return candidate
    return delivery.entry_id


def plan_entry(encoder: Encoder, settings: Settings, delivery: Delivery, body: bytes | None
               ) -> tuple[Request, list[Chunk]]:
    """Raises RequestError (answered at once, never retried) for bad input and expired deadlines."""
    raw = body if body is not None else delivery.fields.get(b"body")
    if raw is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "the entry has no 'body' field")
    if len(raw) > settings.max_entry_bytes:
        raise RequestError(ErrorCode.TOO_LARGE,
                           f"the entry is {len(raw)} bytes; this worker takes at most {settings.max_entry_bytes}")
    request = parse_request(raw)
    if request.deadline_ms is not None and time.time() * 1000 > request.deadline_ms:
        late = time.time() * 1000 - request.deadline_ms
        raise RequestError(ErrorCode.DEADLINE_EXCEEDED, f"the deadline passed {late:.0f} ms before compute")
    names = json.loads(delivery.fields[b"questions"]) if delivery.stream == CHUNKS else None
    return request, encoder.plan(request, names)


# ---- planner processes: one encoder per process, errors returned as values (they cross a pickle boundary)

_PROCESS_ENCODER: Encoder | None = None
_PROCESS_SETTINGS: Settings | None = None


def _exit_with_parent(parent: int) -> None:
    """A worker killed with SIGKILL cannot stop its planners: they leave on their own when it is gone (the
    parent's pid comes from the parent: a child that starts after its death exits at once)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _init_process(spec: RenderSpec, settings: Settings, parent: int) -> None:
    global _PROCESS_ENCODER, _PROCESS_SETTINGS
    import torch

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    _PROCESS_ENCODER, _PROCESS_SETTINGS = Encoder(spec, settings.max_image_pixels), settings


def _plan_in_process(delivery: Delivery, body: bytes | None) -> Any:
    assert _PROCESS_ENCODER is not None and _PROCESS_SETTINGS is not None
    try:
        request, chunks = plan_entry(_PROCESS_ENCODER, _PROCESS_SETTINGS, delivery, body)
    except RequestError as error:
        return (error.code, error.message)
    return request, [_to_arrays(chunk) for chunk in chunks]


# Tensors cross the process boundary as numpy arrays, pickled by value: torch's own reduction shares each tensor
# through a file descriptor handed over a fresh authenticated connection, which costs milliseconds per tensor and
# holds the worker's GIL while it does.
_TENSORS = ("input_ids", "rows", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _to_arrays(chunk: Chunk) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(chunk, name) for name in _TENSORS}
    out = {name: None if value is None else value.numpy() for name, value in out.items()}
    out["questions"] = chunk.questions
    return out


def _from_arrays(fields: dict[str, Any]) -> Chunk:
    import torch

    return Chunk(questions=fields["questions"], **{
        name: None if fields[name] is None else torch.from_numpy(fields[name]) for name in _TENSORS})


class Planner:
    """``submit`` returns a future of the entry's Task; bad input fails the future with RequestError."""

    def __init__(self, model: DecisionModel, settings: Settings) -> None:
        self.model, self.settings = model, settings
        self._local = threading.local()
        self.processes = settings.planner_processes
        if self.processes > 0:
            # spawn: a forked child of a process that touched CUDA is unusable.
            self.pool: Executor = ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"),
                                                      initializer=_init_process,
                                                      initargs=(model.render_spec(), settings, os.getpid()))
        else:
            self.pool = ThreadPoolExecutor(settings.planner_threads, thread_name_prefix="planner")

    def warmup(self) -> None:
        """Start the planner processes now (they import transformers), not on the first request."""
        if self.processes > 0:
            for future in [self.pool.submit(time.sleep, 0) for _ in range(self.processes)]:
                future.result()

    def _encoder(self) -> Encoder:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:  # tokenizers are not shareable across threads: one encoder per thread
            encoder = self._local.encoder = Encoder(self.model, self.settings.max_image_pixels)
        return encoder

    def _plan_in_thread(self, delivery: Delivery, body: bytes | None) -> tuple[Request, list[Chunk]]:
        return plan_entry(self._encoder(), self.settings, delivery, body)

    def submit(self, delivery: Delivery, body: bytes | None = None) -> Future[Task]:
        out: Future[Task] = Future()
        work = _plan_in_process if self.processes > 0 else self._plan_in_thread
        inner = self.pool.submit(work, delivery, body)

        def done(finished: Future) -> None:
            try:
                value = finished.result()
            except BaseException as error:  # noqa: BLE001 - handed to the caller as is
                out.set_exception(error)
                return
            if isinstance(value, tuple) and isinstance(value[0], ErrorCode):
                out.set_exception(RequestError(*value))
                return
            request, chunks = value
            if self.processes > 0:
                chunks = [_from_arrays(chunk) for chunk in chunks]
            task = Task(delivery=delivery, request_id=request_id_of(delivery), request=request, chunks=chunks,
                        remaining=len(chunks))
            if delivery.stream == CHUNKS:
                task.part, task.parts = int(delivery.fields[b"part"]), int(delivery.fields[b"parts"])
            out.set_result(task)

        inner.add_done_callback(done)
        return out

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
