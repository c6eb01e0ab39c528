"""The worker daemon: three owners wired together, each with its threads, and the stop. The words for what
passes through (entry, request, part, delivery, task, prompt, pack, outcome, ...) are the README's glossary.

Threads, one folder each: the Redis loop thread (asyncio, loop/thread.py) owns every held entry and task from
taken to let go: the readers and maintenance, the lifecycle, the settle loop; the planners' threads or
processes (plan/) parse, render and tokenize; the main thread runs the GPU stage (gpu/compute.py), which hands
its events to the loop thread. A stop (SIGTERM, through ``on_signal``) stops reading, finishes and settles
what is held, and exits 0.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from typing import Any

from producer import __version__
from producer.plumbing import traces

from .config import Settings
from .gpu.compute import Compute
from .gpu.packer import Packer
from .health import Snapshot
from .loop.thread import LoopThread
from .metrics import Metrics
from .model import checkpoint
from .model.engine import Engine
from .model.reference import ReferenceAdapter
from .plan.planner import Planner
from .traces import Traces

log = logging.getLogger("worker")


def create_engine(model: checkpoint.DecisionModel, settings: Settings) -> Engine:
    """``auto``: the fast engine on CUDA, the reference engine elsewhere."""
    kind = settings.engine
    if kind == "auto":
        kind = "fast" if model.device.type == "cuda" else "reference"
    if settings.deterministic and kind == "reference" and model.device.type != "cpu":
        # transformers' modules run fla's kernels on a GPU, which pick their configuration by timing, per
        # process.
        raise ValueError("--deterministic (DQ_DETERMINISTIC) runs on the fast engine on a GPU or the "
                         f"reference engine on the CPU, not the reference engine on {model.device}; run with "
                         "--engine fast, or with --no-deterministic (docs/RELIABILITY.md, \"Deterministic "
                         "mode\")")
    if kind == "reference":
        from .fast import deterministic  # where it is on by default, and why (logged), the fast engine's too

        chosen = deterministic.decide(model, settings.replace(engine="reference"))
        return ReferenceAdapter(model, settings.replace(deterministic=chosen))
    if kind == "fast":
        from .fast import FastEngine  # needs CUDA and flash-linear-attention; says so clearly if missing

        return FastEngine(model, settings)
    raise ValueError(f"engine must be auto, fast or reference, got {settings.engine!r}")


class Daemon:
    """One worker process: the loop thread, the planners and the GPU stage, from warm-up to drained stop."""

    # How a fatal error ends the process (no drain can help): replaced by in-process tests, which must not end
    # too.
    exit = staticmethod(os._exit)

    def __init__(self, settings: Settings, model: checkpoint.DecisionModel | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(shard=settings.shard)
        if settings.deterministic:
            from .fast import deterministic

            deterministic.prepare_process()  # cuBLAS reads it when it starts: before the first GPU matmul
        self.model = model or checkpoint.load(settings.checkpoint, settings.device, settings.dtype,
                                              settings.max_prompt_tokens)
        self.engine = create_engine(self.model, settings)
        self.settings = settings = settings.replace(deterministic=self.engine.deterministic)  # as decided
        self.ready = threading.Event()
        # The names it serves under, the one results say first (the gateway routes System One calls by them).
        self.served = settings.served_names or (self.model.name,)
        self.planner = Planner(self.model, settings, on_crash=self.metrics.planner_crashes.inc,
                               fatal=lambda code: self.exit(code))
        self.packer = Packer(self.engine.max_pack_tokens, settings.max_wait_ms / 1000, settings.normal_share,
                             self.engine.pack_sizes, settings.high_target_ms / 1000)
        tracing = Traces.configured()  # None unless an OTLP endpoint is set (producer/plumbing/traces.py)
        self.loop = LoopThread(settings, self.metrics, self.planner, self.packer, self.served,
                               self.engine.name, state=self._state, fatal=lambda code: self.exit(code),
                               traces=tracing)
        self.compute = Compute(self.model, self.engine, self.packer, self.metrics, sink=self.loop,
                               traces=tracing, fatal=lambda code: self.exit(code))
        self.metrics.built(__version__, self.served[0], self.engine.name, str(self.model.device),
                           self.engine.deterministic)
        self.metrics.retains(settings.result_ttl_s, settings.record_ttl)

    def run(self, after_warmup: Any = None, burst: bool = False) -> int:
        """Serve until ``stop`` (SIGTERM, from ``serve``). ``after_warmup``: once warm, before ready
        (benchmarks). ``burst``: stop once nothing is held and every lane's read, begun after the last entry
        was let go, found nothing new (in-process tests)."""
        self.loop.start()
        self.planner.warmup()
        self.engine.warmup()
        if after_warmup is not None:
            after_warmup()
        # What start-up made (modules, compiled graphs) lives as long as the process: frozen, the collector's
        # full passes under traffic no longer walk it (a pause that grows with what compilation left behind).
        collect = time.perf_counter()
        gc.collect()
        gc.freeze()
        log.info("start-up objects frozen: %d (collection %.2fs)", gc.get_freeze_count(),
                 time.perf_counter() - collect)
        # A full pass walks every live object (the held entries of a backlog) while every thread waits: up to
        # 100 ms at the 2B shape, a few times a minute by default. Young passes as before; a full one a
        # hundred times rarer.
        gc.set_threshold(700, 10, 1000)
        self.ready.set()
        deadline = time.monotonic() + 2.0  # first contact runs beside the warm-up: normally done by now
        while not self.loop.reachable and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("%s: model %s, engine %s on %s, consumer %s", "ready" if self.loop.reachable else
                 f"warm, ready once Redis at {self.loop.where} answers", ", ".join(self.served),
                 self.engine.name, self.model.device, self.settings.consumer_name)
        with self.metrics.collector_pauses():  # each pass of the collector timed, while serving
            self.compute.run(lambda: (self._burst_over() if burst else self.loop.stopping.is_set())
                             and self.loop.drained())
        self.loop.join(timeout=max(5.0, self.settings.drain_timeout_s))
        self.planner.shutdown()
        self.loop.last_word()
        traces.shutdown()  # what is buffered, exported (nothing when off)
        return 0

    def _state(self) -> str:
        """What the heartbeat says this worker is doing (``dq-producer stats``)."""
        return "draining" if self.loop.stopping.is_set() else "ready" if self.ready.is_set() else "warming"

    def _burst_over(self) -> bool:
        if self.loop.idle():
            self.stop()
        return self.loop.stopping.is_set()

    def stop(self) -> None:
        """Stop reading; what is held is finished and settled within --drain-timeout-s."""
        self.loop.stop()

    def snapshot(self) -> Snapshot:
        """What health decides from (any thread: each value is read once)."""
        loop = self.loop
        beats = {"reader": loop.read_turn, "gpu": self.compute.turned_at}
        return Snapshot(beats={name: beat for name, beat in beats.items() if beat is not None},
                        reading_since=loop.reading_since, loop_running=loop.running, redis_ok=loop.reachable,
                        library_ok=loop.library_ok, present=loop.present, ready=self.ready.is_set(), inflight=loop.inflight,
                        stopping=loop.stopping.is_set(), block_ms=self.settings.block_ms,
                        refusing=loop.refusing, oldest_taken=loop.oldest_taken, released_at=loop.released_at,
                        stall_s=self.settings.stall_timeout_s)

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        if self.loop.stopping.is_set():
            log.warning("second signal: exiting without draining")
            self.exit(1)
        log.info("%s: draining %d in-flight entries", signal.Signals(signum).name, self.loop.inflight)
        self.stop()
