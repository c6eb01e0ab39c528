"""The worker daemon: the stages wired together, their threads, the stop and its drain. The words for what passes
through (entry, request, part, delivery, task, prompt, pack, outcome, ...) are the README's glossary.

Threads, one folder each: the Redis loop thread (asyncio, loop/) runs the readers and maintenance (intake.py), every
held entry and task from taken to let go (lifecycle.py, held.py) and the settle loop (settler.py); the planners'
threads or processes (plan/) parse, render and tokenize; the main thread runs the GPU stage (gpu/compute.py).
A stop (SIGTERM, through ``on_signal``) stops reading, finishes and settles what is held, and exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from typing import Any

from producer import __version__
from producer.wire import traces
from producer.wire.keys import Keys
from producer.wire.supported import UnsupportedServer

from .config import Settings
from .gpu.compute import Compute
from .gpu.packer import Packer
from .health import Snapshot
from .loop.consumer import Consumer
from .loop.intake import Intake
from .loop.lifecycle import Lifecycle
from .loop.presence import Presence
from .loop.publisher import Publisher
from .loop.redis_calls import REDIS_ERRORS, RedisCalls
from .loop.redis_calls import client as redis_client
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
        # transformers' modules run fla's kernels on a GPU, which pick their configuration by timing, per process.
        raise ValueError(f"--deterministic (DQ_DETERMINISTIC) runs on the fast engine on a GPU or the reference "
                         f"engine on the CPU, not the reference engine on {model.device}; run with --engine fast, "
                         f"or without --deterministic (docs/RELIABILITY.md, \"Deterministic mode\")")
    if kind == "reference":
        return ReferenceAdapter(model, settings)
    if kind == "fast":
        from .fast import FastEngine  # needs CUDA and flash-linear-attention; says so clearly if missing

        return FastEngine(model, settings)
    raise ValueError(f"engine must be auto, fast or reference, got {settings.engine!r}")


class Daemon:
    # How a fatal error ends the process (no drain can help): replaced by in-process tests, which must not end too.
    exit = staticmethod(os._exit)

    def __init__(self, settings: Settings, model: checkpoint.DecisionModel | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace, settings.shard)
        self.metrics = Metrics(shard=settings.shard)
        if settings.deterministic:
            from .fast import deterministic

            deterministic.prepare_process()  # cuBLAS reads it when it starts: before the first GPU matmul
        self.model = model or checkpoint.load(settings.checkpoint, settings.device, settings.dtype,
                                              settings.max_prompt_tokens)
        self.engine = create_engine(self.model, settings)
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.stop_deadline = float("inf")
        self.loop = asyncio.new_event_loop()  # runs on the "redis" thread
        client = redis_client(settings)
        # A call that cannot reach Redis stops retrying once stopping with nothing left to save, or past the drain.
        self.redis_calls = RedisCalls(client, self.metrics, where=settings.redis_where, give_up=lambda: (
            self.stopping.is_set() and (not self.lifecycle.held or time.monotonic() > self.stop_deadline)))
        once = redis_client(settings, retries=0)  # for the calls that must not be re-sent by the client (the consumer
        # closes it): entries handed over, and on Redis Cluster in durable mode each primary's writes and its WAIT
        consumer = Consumer(client, self.keys, settings.consumer_name, settings.max_entry_bytes, once=once,
                            max_read_bytes=settings.max_read_bytes)
        # The names it serves under, the one results say first (the gateway routes System One calls by them).
        self.served = settings.served_names or (self.model.name,)
        presence = Presence(client, self.keys, settings.consumer_name, list(consumer.streams),
                            settings.consumer_gone_ms,
                            {"model": self.served[0], "models": list(self.served), "engine": self.engine.name,
                             "shard": settings.shard}, self._state)
        self.publisher = Publisher(client, self.keys, settings.result_ttl_s, self.served[0], settings.reply_maxlen,
                                   settings.dead_maxlen, settings.wait_replicas, once)
        self.planner = Planner(self.model, settings, on_crash=self.metrics.planner_crashes.inc,
                               fatal=lambda code: self.exit(code))
        self.packer = Packer(self.engine.max_pack_tokens, settings.max_wait_ms / 1000, settings.normal_share,
                             self.engine.pack_sizes, settings.high_target_ms / 1000)
        self.traces = Traces.configured()  # None unless an OTLP endpoint is set (producer/wire/traces.py)
        self.lifecycle = Lifecycle(self.keys, settings, self.metrics, self.redis_calls, consumer, self.planner,
                                   self.packer, self.publisher, self.loop, self.traces)
        self.intake = Intake(consumer, self.lifecycle, self.redis_calls, settings, self.metrics, self.stopping,
                             presence)
        self.compute = Compute(self.model, self.engine, self.packer, self.metrics, sink=self.lifecycle,
                               traces=self.traces)
        self.metrics.built(__version__, self.served[0], self.engine.name, str(self.model.device))

    # ---------------------------------------------------------------- lifecycle (main thread)

    def run(self, after_warmup: Any = None, burst: bool = False) -> int:
        """Serve until ``stop`` (SIGTERM, from ``serve``). ``after_warmup``: once warm, before ready (benchmarks).
        ``burst``: stop once nothing is held and every lane's read, begun after the last entry was let go, found
        nothing new (in-process tests)."""
        redis_thread = threading.Thread(target=self._run_loop, name="redis", daemon=True)
        redis_thread.start()
        self.planner.warmup()
        self.engine.warmup()
        if after_warmup is not None:
            after_warmup()
        # What start-up made (modules, compiled graphs) lives as long as the process: frozen, the collector's full
        # passes under traffic no longer walk it (a pause that grows with what compilation left behind).
        collect = time.perf_counter()
        gc.collect()
        gc.freeze()
        log.info("start-up objects frozen: %d (collection %.2fs)", gc.get_freeze_count(), time.perf_counter() - collect)
        # A full pass walks every live object (the held entries of a backlog) while every thread waits: up to 100 ms
        # at the 2B shape, a few times a minute by default. Young passes as before; a full one a hundred times rarer.
        gc.set_threshold(700, 10, 1000)
        self.ready.set()
        deadline = time.monotonic() + 2.0  # first contact runs beside the warm-up: normally done by now
        while not self.redis_calls.reachable and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("%s: model %s, engine %s on %s, consumer %s", "ready" if self.redis_calls.reachable else
                 f"warm, ready once Redis at {self.redis_calls.where} answers", ", ".join(self.served),
                 self.engine.name, self.model.device, self.settings.consumer_name)
        with self.metrics.collector_pauses():  # each pass of the collector timed, while serving
            self.compute.run(lambda: (self._burst_over() if burst else self.stopping.is_set()) and self._drained())
        redis_thread.join(timeout=max(5.0, self.settings.drain_timeout_s))
        self.planner.shutdown()
        self._last_word(len(self.lifecycle.held))
        traces.shutdown()  # what is buffered, exported (nothing when off)
        return 0

    def _state(self) -> str:
        """What the heartbeat says this worker is doing (``dq-producer stats``)."""
        return "draining" if self.stopping.is_set() else "ready" if self.ready.is_set() else "warming"

    def _burst_over(self) -> bool:
        empty_since = self.intake.streams_empty_since
        held = self.lifecycle.held
        if not held and empty_since is not None and empty_since > (held.released_at or 0.0):
            self.stop()
        return self.stopping.is_set()

    def _last_word(self, held: int) -> None:
        """What the stop left behind, saying only what this worker knows."""
        where, consumer, claim = self.redis_calls.where, self.settings.consumer_name, self.settings.claim_idle_ms
        if not self.redis_calls.reached:
            log.warning("stopped without ever reaching Redis at %s: this worker took no entry; what an earlier run "
                        "of consumer %s left pending there stays pending", where, consumer)
        elif held and not self.redis_calls.reachable:
            log.warning("stopped with Redis unreachable at %s: %d entries taken were not acknowledged; they stay "
                        "pending for consumer %s, and other workers reclaim them after %d ms", where, held, consumer,
                        claim)
        elif held:
            log.warning("stopped at the drain deadline: %d entries left pending for consumer %s; other workers "
                        "reclaim them after %d ms", held, consumer, claim)
        else:
            log.info("stopped: every entry this worker took was answered and acknowledged")

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.stop_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.stopping.set()

    def snapshot(self) -> Snapshot:
        """What health decides from (any thread: each value is read once)."""
        beats = {"reader": self.intake.read_turn, "gpu": self.compute.turned_at}
        return Snapshot(beats={name: beat for name, beat in beats.items() if beat is not None},
                        reading_since=self.intake.reading_since, loop_running=self.loop.is_running(),
                        redis_ok=self.redis_calls.reachable, library_ok=self.publisher.library.ok,
                        ready=self.ready.is_set(), inflight=len(self.lifecycle.held),
                        stopping=self.stopping.is_set(), block_ms=self.settings.block_ms,
                        refusing=self.redis_calls.refusing, oldest_taken=self.lifecycle.held.oldest_taken(),
                        released_at=self.lifecycle.held.released_at, stall_s=self.settings.stall_timeout_s)

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        if self.stopping.is_set():
            log.warning("second signal: exiting without draining")
            self.exit(1)
        log.info("%s: draining %d in-flight entries", signal.Signals(signum).name, len(self.lifecycle.held))
        self.stop()

    def _drained(self) -> bool:
        return not self.lifecycle.held or time.monotonic() > self.stop_deadline

    # ---------------------------------------------------------------- asyncio thread

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except UnsupportedServer as error:  # the same settings would fail the same way: no restart loop
            log.error("cannot serve: %s", error)
            self.exit(2)
        except Exception:  # noqa: BLE001 - e.g. a client bug on a reconnect: the worker would never read again
            if not self.stopping.is_set():
                log.critical("the Redis loop failed: exiting so that the supervisor restarts this worker",
                             exc_info=True)
                self.exit(70)
            raise
        finally:
            self.loop.close()

    async def _main(self) -> None:
        try:
            await self.redis_calls.introduce()
            await self.intake.start()
        except REDIS_ERRORS:  # stopped before Redis ever answered: nothing was taken, nothing to settle
            return
        loops = [asyncio.create_task(loop()) for loop in (self.lifecycle.settler.run, self.intake.run_maintenance,
                                                           self.publisher.library.watch, self.lifecycle.cancels.run)]
        reader = asyncio.create_task(self.intake.run_reader())  # until stopping
        while not (self.stopping.is_set() or reader.done()):
            await asyncio.sleep(0.1)
        # A read in progress ends within its BLOCK time, unless Redis does not answer: then it is abandoned (what it
        # would have delivered stays pending for this consumer: reclaimed, or re-read on restart).
        await asyncio.wait({reader}, timeout=self.settings.block_ms / 1000 + 1.0)
        reader.cancel()
        if reader.done() and not reader.cancelled() and reader.exception():
            raise reader.exception()
        while not self._drained():
            await asyncio.sleep(0.05)
        for task in loops:
            task.cancel()
        try:
            if self.redis_calls.reachable:  # best effort: a heartbeat left behind is forgotten by the others
                await asyncio.wait_for(self.intake.leave(), timeout=2.0)
            await self.redis_calls.close()
            await self.intake.consumer.close()
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            pass
