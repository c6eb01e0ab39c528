"""The GPU stage: packs from the packer through the engine, head scores to answers, handed to the Redis loop.

Runs on the main thread. While pack n is on the GPU, the packer is asked for pack n+1 (worker/gpu/packer.py):
it forms one just before n is expected to end (at once if it is full and no high work flows), with everything
that arrived by then. It is launched first, then n is read out (temperatures, softmax, System One answers) and
handed over (``Sink``: the Redis loop thread, which owns every task's state): the GPU never waits for the
read-out and the launch's host work. With nothing queued by then, or n done already, n is read out first and
the next pack formed after it, with what arrived meanwhile. The packer learns from each pack its launch's host
time and its run on the device (the pack policy's costs).

A failing pack is bisected until the failing prompt is alone, so the others in it are still answered.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable, Protocol

import torch

from ..metrics import Metrics
from ..model.checkpoint import DecisionModel
from ..model.engine import Engine, Pending, PackRun
from ..model.readout import answer, option_logits
from ..tasks import Computed, Expired, Failed, GpuEvent, Item, Launched
from ..traces import Traces
from .packer import Packer

log = logging.getLogger("worker")
GIL_SWITCH_S = 0.0001  # while the GPU stage runs, the GIL changes hands within this (Python's default: 5 ms)


class Sink(Protocol):
    """Where each fact about the work goes (worker/loop/thread.py); called on this (the GPU) thread, with a
    pack's read-out in one call."""

    def hand_over(self, *events: GpuEvent) -> None: ...


class Compute:
    """The GPU stage: packs through the engine, their answers handed to the sink."""

    def __init__(self, model: DecisionModel, engine: Engine, packer: Packer, metrics: Metrics, sink: Sink,
                 traces: Traces | None = None, fatal: Callable[[int], None] = os._exit) -> None:
        self.model, self.engine, self.packer, self.metrics, self.sink = model, engine, packer, metrics, sink
        self.traces = traces  # None: tracing off
        self.fatal = fatal  # how a failed GPU ends the process (the daemon's exit seam)
        self.turned_at: float | None = None  # the loop's last turn (liveness)

    def run(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` holds with no pack in flight. Meanwhile the process's GIL changes hands within
        ``GIL_SWITCH_S``: a launch gives the GIL up at each graph replay and kernel call, and takes it back
        behind whichever thread holds it (the Redis loop, the planners' result thread), by default for up to
        5 ms each time; about a hundred times per pack at the 2B shape, that stretched packs on the GPU, which waited
        for the host (docs/BENCHMARKS.md, "Where the end-to-end ratio goes"). At 0.5 ms a slow host's packs
        still waited (the gate at 72aab1e: about 5 ms per 16k pack inside it, 4% of the peak between packs); 0.1
        ms shortens each wait further, and the other threads lose little to it, since they are forced to switch
        only while this one waits (ops/bench/gil_launch.py models it on the CPU: a smaller step than 5 to 0.5)."""
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, GIL_SWITCH_S))
        try:
            self._run(done)
        finally:
            sys.setswitchinterval(switch)

    def _run(self, done: Callable[[], bool]) -> None:
        in_flight: tuple[list[Item], Pending] | None = None
        while True:
            finishing = done()
            if in_flight is None and finishing:
                return
            self.turned_at = time.time()
            self.metrics.heartbeat.labels("gpu").set(self.turned_at)
            # past the drain deadline: no new pack; while a pack runs, the next just before it ends, or none
            pack = [] if finishing else self._take(wait=in_flight is None, behind=in_flight is not None)
            if in_flight is not None and not pack:
                self._finish(*in_flight)
                in_flight = None
                continue
            pending = self._launch(pack) if pack else None
            launched = (pack, pending) if pending is not None else None
            if in_flight is not None:
                self._finish(*in_flight)
            in_flight = launched

    def _launch(self, pack: list[Item]) -> Pending | None:
        """The pack onto the GPU, told to the packer and the sink; a launch that fails is isolated at once,
        prompt by prompt (None)."""
        began, clock_began = time.time(), self.packer.clock.now()
        try:
            pending = self.engine.launch([item.prompt for item in pack])
        except Exception as error:  # noqa: BLE001 - isolated, prompt by prompt
            self._isolate(pack, error)
            return None
        self.metrics.launch.observe(time.time() - began)
        self.packer.launched(sum(item.tokens for item in pack), clock_began, pending)
        self.sink.hand_over(Launched(tuple(pack), began))
        return pending

    def _take(self, wait: bool, behind: bool) -> list[Item]:
        pack = []
        for item in self.packer.next(wait=wait, behind=behind):
            if item.task.closed:
                continue
            if item.task.expired:  # no compute for work past its deadline
                self.sink.hand_over(Expired(item.task))
                continue
            pack.append(item)
        return pack

    def _finish(self, pack: list[Item], pending: Pending) -> None:
        try:
            run = pending.wait()
        except Exception as error:  # noqa: BLE001
            self.packer.finished(pending, None)
            self._isolate(pack, error)
            return
        self.packer.finished(pending, run.gpu_seconds if run.gpu_seconds is not None else run.seconds)
        self._record(run)
        self._read_out(pack, run)

    def _read_out(self, pack: list[Item], run: PackRun) -> None:
        """Each prompt's answers from its head scores, handed over."""
        self.metrics.prompts.inc(len(pack))
        if self.traces is not None:
            ended = time.time()
            self.traces.computed(list({id(item.task): item.task.delivery for item in pack}.values()),
                                 ended - run.seconds, ended, run.bucket, run.tokens)
        config, computed = self.model.decision_config, []
        for item, scores in zip(pack, run.scores):
            questions = item.prompt.questions
            answers = [answer(config, q, logits)
                       for q, logits in zip(questions, option_logits(self.model, questions, scores))]
            computed.append(Computed(item, answers, run.seconds * item.prompt.length / max(run.tokens, 1)))
        # In one hand-over: each wakes the loop thread through a socket, a call that lets the GIL go.
        self.sink.hand_over(*computed)

    def _record(self, run: PackRun) -> None:
        metrics = self.metrics
        metrics.forward.labels(str(run.bucket) if run.bucket else "eager").observe(run.seconds)
        if run.gpu_seconds is not None:
            metrics.pack_gpu.observe(run.gpu_seconds)
        if run.idle_seconds is not None:
            metrics.gpu_idle.observe(run.idle_seconds)
        metrics.fill.observe(run.tokens / max(run.capacity, 1))
        metrics.tokens.inc(run.tokens)
        metrics.packs.labels("graph" if run.graph else "eager").inc()
        device = self.model.device
        if device.type == "cuda":
            metrics.gpu_memory.labels("allocated").set(torch.cuda.memory_allocated(device))
            metrics.gpu_memory.labels("reserved").set(torch.cuda.memory_reserved(device))
            metrics.gpu_memory_peak.set(torch.cuda.max_memory_allocated(device))

    def _isolate(self, pack: list[Item], error: BaseException) -> None:
        """A failed pack: run halves again until the failing prompt is alone; the others are answered."""
        if isinstance(error, getattr(torch, "AcceleratorError", ())):
            log.critical("the GPU failed (%s): exiting so that the supervisor restarts this worker", error)
            self.fatal(70)
            return  # an exit that returns (a test's) stops the worker: the entries stay held, then pending
        if len(pack) == 1:
            log.warning("prompt of %s failed: %r", pack[0].task.request_id, error,
                        extra=pack[0].task.delivery.log_fields)
            self.sink.hand_over(Failed(pack[0].task, f"{type(error).__name__}: {error}"))
            return
        for half in (pack[: len(pack) // 2], pack[len(pack) // 2:]):
            if (pending := self._launch(half)) is not None:
                self._finish(half, pending)
