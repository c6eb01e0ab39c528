"""Entry -> task: the body parsed once (its identity too), validated, its deadline checked, rendered and tokenized,
beside the GPU; and whether the task fans out (a request too long for one worker in good time is sent back as parts
any worker may take).

Planning is mostly Python (templates, validation): in threads it competes with the GPU thread for the GIL, so a
busy GPU worker plans in separate processes (``--planner-processes``), each with its own encoder built from the
checkpoint's render spec (tokenizer, template; no weights). Threads suit CPU runs and small deployments. Entries
wait for a planner in lane order (worker/plan/pool.py): a high entry never queues behind hundreds of normal ones.
With processes, a text entry that finds them idle is planned in a thread of the worker instead (no process hop).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable

from producer.wire.keys import Keys
from producer.wire.digest import body_digest, digest
from producer.wire.schema import ErrorCode, Request, RequestError, validate

from ..config import Settings
from ..entries import REQUESTS, Delivery, Identity, Job, Refusal, identity_of, request_digest
from ..model.checkpoint import DecisionModel, RenderSpec
from ..model.encoder import Encoder
from ..model.engine import Prompt
from ..tasks import Task
from .pool import LaneQueue, PlannerCrashed

log = logging.getLogger(__name__)


def plan_entry(encoder: Encoder, settings: Settings, job: Job) -> tuple[Identity, Request, list[Prompt]] | Refusal:
    """A request body planned whole, or only a part's questions: the request, its prompts, and the identity from the
    same parse (with its digest, which every result of it carries); or a Refusal (bad input, an expired deadline). A
    planner bug raises."""
    keys = Keys(settings.namespace)
    identity, body, error = identity_of(keys, job)
    if job.invalid is not None:
        return Refusal(dataclasses.replace(identity, digest=request_digest(job, body)), job.invalid_code, job.invalid)
    if body is None and error is None:  # a part whose request body is gone: nothing says what it asked
        return Refusal(identity, ErrorCode.INTERNAL, "the request body of this part is gone (Redis lost it?)")
    try:
        try:
            if error is not None:
                raise error
            request = validate(body or {})
        except RequestError:  # not JSON, or not a request: its body's bytes are what it asked
            identity = dataclasses.replace(identity, digest=body_digest(job.raw or b""))
            raise
        identity = dataclasses.replace(identity, digest=digest(request))
        if request.reply_to is not None and not keys.is_reply_stream(request.reply_to):
            raise RequestError(ErrorCode.INVALID_REQUEST, f"reply_to must be a reply stream of this deployment: "
                                                          f"{keys.reply_prefix} then 1-128 of A-Z a-z 0-9 . _ : -")
        if request.priority is not None and request.priority != job.lane:  # the stream is the lane
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"priority: {request.priority!r} was sent to the {job.lane} lane's stream; send it to "
                               f"the {request.priority} lane's stream, or leave priority out to be served in this one")
        if request.deadline_ms is not None and time.time() * 1000 > request.deadline_ms:
            late = time.time() * 1000 - request.deadline_ms
            raise RequestError(ErrorCode.DEADLINE_EXCEEDED, f"the deadline passed {late:.0f} ms before compute")
        return identity, request, encoder.prompts(request, job.questions)
    except RequestError as refused:
        return Refusal(identity, refused.code, refused.message)


def part_groups(task: Task, budget: int) -> list[list[str]]:
    """Consecutive prompts grouped into parts of at most ``budget`` tokens (a longer prompt is a part alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for prompt in task.prompts:
        if groups[-1] and used + prompt.length > budget:
            groups.append([])
            used = 0
        groups[-1].extend(q.name for q in prompt.questions)
        used += prompt.length
    return groups


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

    from ..logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)  # a planner's lines as the worker's (JSON mode too)

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    _PROCESS_ENCODER, _PROCESS_SETTINGS = Encoder(spec, settings.max_image_pixels), settings


def _plan_in_process(job: Job) -> Any:
    assert _PROCESS_ENCODER is not None and _PROCESS_SETTINGS is not None
    planned = plan_entry(_PROCESS_ENCODER, _PROCESS_SETTINGS, job)
    if isinstance(planned, Refusal):
        return planned
    identity, request, prompts = planned
    return identity, request, [_to_arrays(prompt) for prompt in prompts]


# Tensors cross the process boundary as numpy arrays, pickled by value: torch's own reduction shares each tensor
# through a file descriptor handed over a fresh authenticated connection, which costs milliseconds per tensor and
# holds the worker's GIL while it does.
_TENSORS = ("input_ids", "rows", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _to_arrays(prompt: Prompt) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(prompt, name) for name in _TENSORS}
    out = {name: None if value is None else value.numpy() for name, value in out.items()}
    out["questions"], out["split"] = prompt.questions, prompt.split
    return out


def _from_arrays(fields: dict[str, Any]) -> Prompt:
    import torch

    return Prompt(questions=fields["questions"], split=fields["split"], **{
        name: None if fields[name] is None else torch.from_numpy(fields[name]) for name in _TENSORS})


def may_hold_images(job: Job) -> bool:
    """Whether the body may hold images: their decoders are native code that can crash, so such an entry is always
    planned in a process (a crash costs a planner, never the worker). A \\u escape could spell "assets": unsure."""
    raw = job.raw or b""
    return b"assets" in raw or b"\\u" in raw


# Entries, each of which killed a planner process alone, with nothing planned in between, that end the worker: so
# many different inputs do not all kill a decoder, the processes cannot run here. One input that kills a planner at
# every delivery counts once: it is dead-lettered after --max-deliveries, the worker stays.
CULPRITS_IN_A_ROW = 5


class Planner:
    """Plans entries beside the GPU: each body parsed once, rendered and tokenized, off the Redis loop thread."""

    def __init__(self, model: DecisionModel, settings: Settings, on_crash: Callable[[], None] = lambda: None,
                 fatal: Callable[[int], None] = os._exit) -> None:
        """``on_crash``: called (from any thread) each time a planner process died and its pool was replaced.
        ``fatal``: how the worker ends when its planner processes keep dying with nothing planned in between."""
        self.model, self.settings, self.on_crash, self.fatal = model, settings, on_crash, fatal
        self._local = threading.local()
        self.processes = settings.planner_processes
        self.crashes = 0
        self.culprits: set[tuple[str, str]] = set()  # entries that killed a planner alone, since one was planned
        pool = self._process_pool() if self.processes > 0 else ThreadPoolExecutor(settings.planner_threads,
                                                                                  thread_name_prefix="planner")
        # Two jobs per planner: one running, one ready to start when it ends.
        self.queue = LaneQueue(pool, 2 * (self.processes or settings.planner_threads), settings.normal_share,
                               renew=self._renew if self.processes > 0 else None)
        # With processes, an entry alone in the worker that finds them idle is planned here, in one thread of the
        # worker: the hop to a process (pickling, the executor's thread, a process waking) cost a lone request 3 to 4
        # of its 17 ms on an H100. Any other entry goes to the processes, which keep the GIL for the GPU thread while
        # packs run; images always do.
        self.here = ThreadPoolExecutor(1, thread_name_prefix="planner-here") if self.processes > 0 else None

    def _process_pool(self) -> ProcessPoolExecutor:
        # spawn: a forked child of a process that touched CUDA is unusable.
        return ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"), initializer=_init_process,
                                   initargs=(self.model.render_spec(), self.settings, os.getpid()))

    def _renew(self, broken: Executor) -> Executor:
        """A planner process died: its pool is broken for good, so planning goes on in a fresh one."""
        self.crashes += 1
        log.error("a planner process died (%d so far): planning goes on in fresh processes; the entries it held are "
                  "planned again one at a time", self.crashes)
        broken.shutdown(wait=False, cancel_futures=True)
        self.on_crash()
        return self._process_pool()

    def _convicted(self, delivery: Delivery) -> None:
        """An entry killed a planner process alone (its future fails with PlannerCrashed)."""
        self.culprits.add((delivery.key, delivery.entry_id))
        if len(self.culprits) >= CULPRITS_IN_A_ROW:
            log.critical("%d different entries each killed a planner process alone, with nothing planned in between: "
                         "the planner processes cannot run here; exiting so that the supervisor restarts this worker",
                         len(self.culprits))
            self.fatal(70)

    @property
    def pool(self) -> Executor:
        return self.queue.pool

    def warmup(self) -> None:
        """Start the planner processes now (they import transformers), and the encoder of the thread that plans
        while they are idle, not on the first request."""
        if self.here is not None:
            self.here.submit(self._encoder).result()
            for future in [self.pool.submit(time.sleep, 0) for _ in range(self.processes)]:
                future.result()

    def _encoder(self) -> Encoder:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:  # tokenizers are not shareable across threads: one encoder per thread
            encoder = self._local.encoder = Encoder(self.model, self.settings.max_image_pixels)
        return encoder

    def _plan_in_thread(self, job: Job) -> tuple[Identity, Request, list[Prompt]] | Refusal:
        return plan_entry(self._encoder(), self.settings, job)

    def submit(self, delivery: Delivery, stored_body: bytes | None = None, alone: bool = False
               ) -> Future[Task | Refusal]:
        """The entry's Task, or its Refusal; a planner bug fails the future. ``stored_body``: a part's request body
        (stored apart when its request fanned out). ``alone``: nothing else is held by the worker (no pack to run)."""
        out: Future[Task | Refusal] = Future()
        job = Job.of(delivery, stored_body)
        # claim_idle: the queue counts it running until it ends
        here = alone and self.here is not None and not may_hold_images(job) and self.queue.claim_idle()
        in_process = self.processes > 0 and not here
        if not here:
            inner = self.queue.submit(delivery.lane, _plan_in_process if in_process else self._plan_in_thread, job)
        else:
            try:
                inner = self.here.submit(self._plan_in_thread, job)
            except RuntimeError as error:  # shut down: failed as the queue fails it
                inner = Future()
                inner.set_exception(error)
            inner.add_done_callback(lambda _: self.queue.release())

        def done(finished: Future) -> None:
            try:
                value = finished.result()
            except BaseException as error:  # noqa: BLE001 - handed to the caller as is
                if isinstance(error, PlannerCrashed):
                    self._convicted(delivery)
                out.set_exception(error)
                return
            if in_process:
                self.culprits.clear()  # a planner process did its work
            if isinstance(value, Refusal):
                out.set_result(value)
                return
            identity, request, prompts = value
            if in_process:
                prompts = [_from_arrays(prompt) for prompt in prompts]
            task = Task(delivery=delivery, identity=identity, request=request, prompts=prompts,
                        remaining=len(prompts))
            task.fan_out = self._fan_out(task)
            out.set_result(task)

        inner.add_done_callback(done)
        return out

    def _fan_out(self, task: Task) -> list[list[str]]:
        """The parts a request over ``--fanout-tokens`` (in several prompts) is sent out as; none to keep it here."""
        budget = self.settings.fanout_tokens
        if task.delivery.stream != REQUESTS or len(task.prompts) < 2 or task.tokens <= budget:
            return []
        groups = part_groups(task, budget)
        return groups if len(groups) > 1 else []

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.here is not None:
            self.here.shutdown(wait=False, cancel_futures=True)
