"""The worker daemon: Redis on one asyncio thread, planning beside it, packs on the main (GPU) thread.

    reader ──> planner (threads or processes) ──> work queue ──> compute: packer, engine, readout ──> settle
      └─ maintenance: own pending on start, reclaim dead consumers, keep long work alive, stats, heartbeat

Queue state (in-flight entries, tasks) lives on the asyncio thread only; the GPU thread hands results back with
``call_soon_threadsafe``. SIGTERM stops reading, finishes and acknowledges what is in flight, and exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import queue
import signal
import threading
import time
from typing import Any

import redis

from producer.client import aconnect
from producer.keys import Keys
from producer.schema import ErrorCode, RequestError

from .compute import Compute
from .config import Settings
from .intake import Intake
from .metrics import Metrics
from .model import checkpoint
from .model.engine import Engine
from .model.readout import Answer
from .model.reference import ReferenceAdapter
from .packer import Packer
from .planner import Planner, request_id_of
from .results import Outcome, Publisher, error_outcome, part_groups, task_outcome
from .tasks import CHUNKS, Delivery, Item, Task

log = logging.getLogger("worker")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
VERSION = "0.1.0"


def reply_to_of(delivery: Delivery, keys: Keys) -> str | None:
    try:
        value = json.loads(delivery.fields.get(b"body", b"")).get("reply_to")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):  # any body at all
        return None
    return value if isinstance(value, str) and value.startswith(keys.reply_prefix) else None


def create_engine(model: checkpoint.DecisionModel, settings: Settings) -> Engine:
    """``auto``: the fast engine on CUDA, the reference engine elsewhere."""
    kind = settings.engine
    if kind == "auto":
        kind = "fast" if model.device.type == "cuda" else "reference"
    if kind == "reference":
        return ReferenceAdapter(model, settings)
    if kind == "fast":
        from .fast import FastEngine  # needs CUDA and flash-linear-attention; says so clearly if missing

        return FastEngine(model, settings)
    raise ValueError(f"engine must be auto, fast or reference, got {settings.engine!r}")


class Daemon:
    def __init__(self, settings: Settings, model: checkpoint.DecisionModel | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace, settings.shard)
        self.consumer = settings.consumer_name
        self.metrics = Metrics()
        self.model = model or checkpoint.load(settings.checkpoint, settings.device, settings.dtype,
                                              settings.max_chunk_tokens)
        self.engine = create_engine(self.model, settings)
        self.planner = Planner(self.model, settings)
        self.work: queue.Queue[Item] = queue.Queue()
        self.packer = Packer(self.work, self.engine.max_pack_tokens, settings.max_wait_ms / 1000)
        self.stopping = threading.Event()
        self.stop_deadline = float("inf")
        self.loop = asyncio.new_event_loop()
        self.inflight: dict[str, Delivery] = {}  # entry id -> delivery; loop thread only
        self.lost: dict[tuple[str, str], None] = {}  # (stream key, entry id) counted as lost; loop thread only
        self.ready = threading.Event()
        self.redis_ok = False
        self.beats: dict[str, float] = {}
        self.reading_since: float | None = None  # the reader is waiting on Redis since (health: Redis' fault, not ours)
        self.metrics.info.labels(VERSION, self.model.name, self.engine.name, str(self.model.device)).set(1)

    # ---------------------------------------------------------------- lifecycle (main thread)

    def run(self, after_warmup: Any = None) -> int:
        """Serve until SIGTERM. ``after_warmup``: called once the engine is warm, before ready (benchmarks)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
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
        self.ready.set()
        log.info("ready: model %s, engine %s on %s, consumer %s", self.model.name, self.engine.name,
                 self.model.device, self.consumer)
        self.compute = Compute(self.model, self.engine, self.packer, self.metrics, self,
                               self.loop.call_soon_threadsafe, self.beats)
        self.compute.run(lambda: self.stopping.is_set() and self._drained())
        redis_thread.join(timeout=max(5.0, self.settings.drain_timeout_s))
        self.planner.shutdown()
        left = len(self.inflight)
        log.info("stopped: %d entries left pending for other workers", left)
        return 0

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.stop_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.stopping.set()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stopping.is_set():
            log.warning("second signal: exiting without draining")
            os._exit(1)
        log.info("%s: draining %d in-flight entries", signal.Signals(signum).name, len(self.inflight))
        self.stop()

    def _drained(self) -> bool:
        return not self.inflight or time.monotonic() > self.stop_deadline

    # ---------------------------------------------------------------- asyncio thread

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except Exception:
            if not self.stopping.is_set():
                log.critical("the Redis loop failed: exiting so that the supervisor restarts this worker",
                             exc_info=True)
                os._exit(70)
            raise
        finally:
            self.loop.close()

    async def _main(self) -> None:
        s = self.settings
        self.redis = aconnect(s.redis_url, s.redis_cluster, **s.redis_options())
        self.intake = Intake(self.redis, self.keys, self.consumer)
        self.publisher = Publisher(self.redis, self.keys, s.result_ttl_s, self.model.name)
        self.outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        self.room = asyncio.Event()
        self.room.set()
        await self._until_connected(self.intake.ensure_groups, "create groups")
        settler = asyncio.create_task(self._settler())
        upkeep = asyncio.create_task(self._maintenance())
        await self._reader()
        while not self._drained():
            await asyncio.sleep(0.05)
        upkeep.cancel()
        settler.cancel()
        try:
            await self.redis.hdel(self.keys.workers(), self.consumer)
            await self.redis.aclose()
        except REDIS_ERRORS:
            pass

    async def _until_connected(self, call: Any, what: str) -> Any:
        delay = 0.1
        while True:
            try:
                result = await call()
                if not self.redis_ok:
                    log.info("redis reachable")
                self.redis_ok = True
                return result
            except REDIS_ERRORS as error:
                self.metrics.redis_errors.labels(what).inc()
                if self.redis_ok:
                    log.warning("redis unreachable (%s): %s; retrying", what, error)
                self.redis_ok = False
                if self.stopping.is_set() and time.monotonic() > self.stop_deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _reader(self) -> None:
        s = self.settings
        recover = True  # own pending entries first: at start, and after a reply may have been lost
        while not self.stopping.is_set():
            self.metrics.heartbeat.labels("reader").set(time.time())
            self.beats["reader"] = time.time()
            self.reading_since = None
            if len(self.inflight) >= s.max_inflight:
                self.room.clear()
                try:
                    await asyncio.wait_for(self.room.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            self.reading_since = time.time()
            try:
                if recover:
                    deliveries = [d for d in await self.intake.own_pending(s.read_count)
                                  if d.entry_id not in self.inflight]
                    how, recover = "recovered", False
                else:
                    deliveries = await self.intake.read(s.read_count, s.block_ms)
                    how = "read"
                self.redis_ok = True
            except redis.ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                await self._group_lost()
                continue
            except REDIS_ERRORS as error:
                self.metrics.redis_errors.labels("read").inc()
                if self.redis_ok:
                    log.warning("redis read failed: %s; retrying", error)
                self.redis_ok, recover = False, True
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                self._accept(delivery, how)

    def _count_lost(self, entries: list[tuple[str, str]]) -> int:
        """Count payload-less pending entries once each: a reclaim may report an entry that the reader is acking
        as lost at the same moment (both saw it in the pending list)."""
        fresh = [e for e in entries if e not in self.lost]
        self.lost.update(dict.fromkeys(fresh))
        while len(self.lost) > 10_000:  # remember recent ones only
            del self.lost[next(iter(self.lost))]
        self.metrics.lost.inc(len(fresh))
        return len(fresh)

    async def _group_lost(self) -> None:
        """Redis lost the group (a restart without persistence, a failover to an empty replica): recreate it once,
        whichever loop noticed first, and report the loss."""
        if await self._until_connected(self.intake.ensure_groups, "create groups"):
            log.error("consumer group missing (Redis lost its data?): recreated it; entries not yet read are lost")
            self.metrics.groups_recreated.inc()

    def _accept(self, d: Delivery, how: str) -> None:
        if d.entry_id in self.inflight:
            return
        m = self.metrics
        self.inflight[d.entry_id] = d
        m.inflight.set(len(self.inflight))
        m.entries.labels(d.stream, how).inc()
        if d.deliveries > 1:
            m.redeliveries.labels(d.stream).inc()
        if d.deliveries <= 1:
            m.queue_wait.observe(max(0.0, d.taken - d.enqueued_ms / 1000))
        if not d.fields:  # pending, but its payload was trimmed away: nothing to answer with
            log.error("entry %s of %s has no payload any more (trimmed?): acknowledged", d.entry_id, d.key)
            self._count_lost([(d.key, d.entry_id)])
            asyncio.ensure_future(self._ack_only(d))
        elif d.deliveries > self.settings.max_deliveries:
            asyncio.ensure_future(self._dead_letter(d, f"delivered {d.deliveries} times without finishing"))
        else:
            asyncio.ensure_future(self._plan(d))

    async def _plan(self, d: Delivery) -> None:
        start = time.perf_counter()
        body = None
        try:
            if d.stream == CHUNKS:
                request_id = request_id_of(d)
                body = await self._until_connected(lambda: self.redis.get(self.keys.body(request_id)), "get body")
                if body is None:
                    raise RequestError(ErrorCode.INTERNAL, "the request body of this part is gone (Redis lost it?)")
            task = await asyncio.wrap_future(self.planner.submit(d, body))
        except RequestError as error:
            self._settle(error_outcome(d, request_id_of(d), error.code, error.message, self.model.name,
                                       reply_to_of(d, self.keys)))
            return
        except Exception as error:
            log.exception("planning %s failed", d.entry_id)
            self._entry_failed(d, f"{type(error).__name__}: {error}")
            return
        finally:
            self.metrics.planning.observe(time.perf_counter() - start)
        if d.stream != CHUNKS and len(task.chunks) > 1 and task.tokens > self.settings.fanout_tokens:
            groups = part_groups(task, self.settings.fanout_tokens)
            if len(groups) > 1:
                await self._until_connected(lambda: self.publisher.fan_out(task, groups), "fan out")
                self.metrics.fanouts.inc()
                self._release(d)
                return
        for index, chunk in enumerate(task.chunks):
            self.work.put(Item(task, index, chunk))

    # ---- outcomes from the GPU thread (worker/compute.py), run here through call_soon_threadsafe

    def chunk_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        task = item.task
        if task.cancelled:
            return
        task.answers.update({a.name: a for a in answers})
        task.compute_seconds += seconds
        task.remaining -= 1
        if task.remaining == 0:
            self._settle(task_outcome(task, self.model.name))

    def task_expired(self, task: Task) -> None:
        if task.cancelled or task.remaining == 0:
            return
        task.cancelled = True
        self._settle(error_outcome(task.delivery, task.request_id, ErrorCode.DEADLINE_EXCEEDED,
                                   "the deadline passed before compute", self.model.name, task.request.reply_to))

    def task_failed(self, task: Task, reason: str) -> None:
        if not task.cancelled:
            task.cancelled = True
            self._entry_failed(task.delivery, reason)

    def _entry_failed(self, d: Delivery, reason: str) -> None:
        """Retry (the delivery counter goes up) until the cap, then dead-letter with an error result."""
        if d.deliveries >= self.settings.max_deliveries:
            asyncio.ensure_future(self._dead_letter(d, reason))
        else:
            self.metrics.retries.inc()
            asyncio.ensure_future(self._retry(d))

    async def _retry(self, d: Delivery) -> None:
        fresh = await self._until_connected(lambda: self.intake.claim_again(d), "claim")
        self._release(d)
        if fresh is not None:
            self._accept(fresh, "retried")

    async def _dead_letter(self, d: Delivery, reason: str) -> None:
        log.error("dead-lettering %s of %s after %d deliveries: %s", d.entry_id, d.key, d.deliveries, reason)
        await self._until_connected(lambda: self.publisher.dead_letter(d, reason), "dead letter")
        self.metrics.dead_letters.inc()
        self._settle(error_outcome(d, request_id_of(d), ErrorCode.DEAD_LETTERED,
                                   f"gave up after {d.deliveries} deliveries: {reason}", self.model.name,
                                   reply_to_of(d, self.keys)))

    async def _ack_only(self, d: Delivery) -> None:
        await self._until_connected(lambda: self.publisher.ack([d]), "ack")
        self._release(d)

    def _release(self, d: Delivery) -> None:
        self.inflight.pop(d.entry_id, None)
        self.metrics.inflight.set(len(self.inflight))
        self.room.set()

    def _settle(self, outcome: Outcome) -> None:
        self.outcomes.put_nowait(outcome)

    async def _settler(self) -> None:
        self._publish_logged = float("-inf")
        while True:
            batch = [await self.outcomes.get()]
            while not self.outcomes.empty() and len(batch) < 512:
                batch.append(self.outcomes.get_nowait())
            try:
                done = await self._until_connected(lambda: self.publisher.settle(batch), "publish")
            except redis.exceptions.NoScriptError:  # the script cache was flushed (restart, failover, SCRIPT FLUSH)
                log.warning("script cache flushed while publishing %d outcomes: publishing them again", len(batch))
                for outcome in batch:  # the pipeline reloads the scripts; settling is idempotent
                    self.outcomes.put_nowait(outcome)
                await asyncio.sleep(0.01)
                continue
            except Exception as error:
                # e.g. OOM (Redis full under noeviction) or NOPERM (ACL): it lasts until an operator acts; one
                # line per 30 s, every failure counted.
                self.metrics.redis_errors.labels("publish").inc()
                if time.monotonic() - self._publish_logged > 30:
                    self._publish_logged = time.monotonic()
                    log.error("publishing %d outcomes failed (%s: %s); retrying every second", len(batch),
                              type(error).__name__, error, exc_info=not isinstance(error, redis.ResponseError))
                for outcome in batch:
                    self.outcomes.put_nowait(outcome)
                await asyncio.sleep(1.0)
                continue
            now = time.time()
            for outcome, result, published in done:
                self._release(outcome.delivery)
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.observe(max(0.0, now - outcome.delivery.enqueued_ms / 1000))

    async def _maintenance(self) -> None:
        s = self.settings
        every = max(0.1, min(5.0, s.claim_idle_ms / 4000))
        last_stats = float("-inf")
        while True:
            self.metrics.heartbeat.labels("maintenance").set(time.time())
            try:
                await self.intake.keep_alive(list(self.inflight.values()))
                reclaimed, gone = await self.intake.reclaim(s.claim_idle_ms, s.read_count)
                if lost := self._count_lost(gone):
                    log.error("%d pending entries had no payload any more (trimmed?)", lost)
                fresh = [d for d in reclaimed if d.entry_id not in self.inflight]
                if fresh:  # one line per reclaim, not one per entry (a dead worker may have held hundreds)
                    log.info("reclaimed %d entries from consumers idle over %d ms", len(fresh), s.claim_idle_ms)
                for d in fresh:
                    log.debug("reclaimed %s of %s (delivery %d)", d.entry_id, d.key, d.deliveries)
                    self._accept(d, "reclaimed")
                if time.monotonic() - last_stats > 5:
                    last_stats = time.monotonic()
                    for stream, st in (await self.intake.group_stats()).items():
                        self.metrics.stream_length.labels(stream).set(st["length"])
                        self.metrics.stream_pending.labels(stream).set(st["pending"])
                        if st["lag"] is not None:
                            self.metrics.stream_lag.labels(stream).set(st["lag"])
                    beat = {"ts": time.time(), "inflight": len(self.inflight), "model": self.model.name,
                            "engine": self.engine.name}
                    await self.redis.hset(self.keys.workers(), self.consumer, json.dumps(beat))
            except redis.ResponseError as error:
                if "NOGROUP" in str(error):  # not left to the reader: it may be waiting for room, not reading
                    await self._group_lost()
                else:
                    log.warning("maintenance: %s", error)
            except REDIS_ERRORS as error:
                self.metrics.redis_errors.labels("maintenance").inc()
                log.debug("maintenance: redis unavailable: %s", error)
            await asyncio.sleep(every)


def serve(settings: Settings) -> int:
    from .logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)
    if not settings.checkpoint:
        log.error("--checkpoint (DQ_CHECKPOINT) is required")
        return 2
    try:
        settings.redis_options()  # a TLS file with a plain redis:// URL: refuse before loading the model
        daemon = Daemon(settings)
    except (checkpoint.CheckpointError, ValueError, ImportError) as error:
        log.error("cannot start: %s", error)
        return 2
    if settings.metrics_port:
        from .health import serve_http

        try:
            serve_http(daemon, settings.metrics_port)
        except OSError as error:
            log.error("cannot serve metrics on port %d: %s", settings.metrics_port, error)
            return 2
    return daemon.run()
