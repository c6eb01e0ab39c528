"""The Redis loop thread (asyncio), owner of every held entry: it builds the parts that run on it, runs their
coroutines on a thread of its own ("redis"), ends them in a drain, and is where the GPU thread hands its
events (``hand_over``). Other threads read its health fields and ask it to stop; nothing else of it.

Its coroutines, all listed in ``_main``: the readers (intake.py), until stopping; the settle loop
(settler.py), maintenance (intake.py), the function library's watch (library_watch.py) and the cancel notices
(cancels.py), until the drain ends. A stop stops reading, waits until nothing is held or the drain deadline
passes, takes this worker's heartbeat out and closes its clients.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from producer.plumbing.supported import UnsupportedServer
from producer.wire.keys import Keys

from ..config import Settings
from ..metrics import Metrics
from ..tasks import GpuEvent
from ..traces import Traces
from .cancels import Cancels
from .consumer import Consumer
from .held import HeldEntries
from .intake import Intake
from .lifecycle import Lifecycle, Packs, Planners
from .presence import Presence
from .publisher import Publisher
from .redis_calls import REDIS_ERRORS, RedisCalls
from .redis_calls import client as redis_client
from .settler import Settler

log = logging.getLogger("worker")


class LoopThread:
    """The Redis loop thread: its parts, its coroutines, the drain, and what health reads of it."""

    def __init__(self, settings: Settings, metrics: Metrics, planner: Planners, packer: Packs,
                 served: Sequence[str] = ("",), engine: str = "", state: Callable[[], str] = lambda: "ready",
                 fatal: Callable[[int], None] = os._exit, traces: Traces | None = None,
                 event_loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``served``: the names the model is served under, the one results say first; ``engine``: the
        engine's name (the heartbeat says both); ``state``: what the heartbeat says this worker is doing;
        ``fatal``: how an error no drain can help ends the process (the daemon's exit seam); ``event_loop``: a
        running one (tests), else one of its own for its thread."""
        self.settings, self.fatal = settings, fatal
        self.event_loop = event_loop or asyncio.new_event_loop()
        self.stopping = threading.Event()
        self.stop_deadline = float("inf")
        keys = Keys(settings.namespace, settings.shard)
        client = redis_client(settings)
        # For the calls the client must not re-send (the consumer closes it): entries handed over, and on
        # Redis Cluster in durable mode each primary's writes and its WAIT.
        once = redis_client(settings, retries=0)
        # A call that cannot reach Redis stops retrying once stopping with nothing left to save, or past the
        # drain.
        self.redis_calls = RedisCalls(client, metrics, where=settings.redis_where,
                                      give_up=lambda: self.stopping.is_set() and self.drained())
        self.held = HeldEntries(settings.max_inflight, metrics)
        self.consumer = Consumer(client, keys, settings.consumer_name, settings.max_entry_bytes, once=once,
                                 max_read_bytes=settings.max_read_bytes)
        self.publisher = Publisher(client, keys, settings.result_ttl_s, served[0], settings.reply_maxlen,
                                   settings.dead_maxlen, settings.wait_replicas, once, settings.record_ttl)
        identity = {"model": served[0], "models": list(served), "engine": engine, "shard": settings.shard}
        self.presence = Presence(client, keys, settings.consumer_name, list(self.consumer.streams),
                                 settings.consumer_gone_ms, identity, state)
        self.settler = Settler(self.publisher, self.redis_calls, metrics, self.held, self.event_loop, traces)
        self.cancels = Cancels(self.redis_calls, keys, settings.consumer_name, settings.block_ms,
                               cancel=lambda request_id: self.lifecycle.cancel(request_id))
        self.lifecycle = Lifecycle(keys, settings, metrics, self.redis_calls, self.consumer, planner, packer,
                                   self.publisher, self.held, self.settler, self.cancels, traces)
        self.intake = Intake(self.consumer, self.lifecycle, self.redis_calls, settings, metrics,
                             self.stopping, self.presence)
        self.thread = threading.Thread(target=self._run, name="redis", daemon=True)

    # ---- other threads: start, stop, hand over, and what health reads (each value read once)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def stop(self) -> None:
        """Stop reading; what is held is finished and settled until the drain deadline (--drain-timeout-s)."""
        if not self.stopping.is_set():
            self.stop_deadline = time.monotonic() + self.settings.drain_timeout_s
            self.stopping.set()

    def drained(self) -> bool:
        """Nothing held, or the drain deadline passed."""
        return not self.held or time.monotonic() > self.stop_deadline

    def idle(self) -> bool:
        """Nothing held, and every lane's read, begun after the last entry was let go, found nothing new (a
        burst run is over)."""
        empty_since = self.intake.streams_empty_since
        return not self.held and empty_since is not None and empty_since > (self.held.released_at or 0.0)

    def hand_over(self, *events: GpuEvent) -> None:
        """The GPU thread's events, onto this thread (``Lifecycle.handle``), in their order, with one wake-up
        of the loop; dropped once a stop past its deadline closed the loop (the entries stay pending)."""
        try:
            self.event_loop.call_soon_threadsafe(self._handle, events)
        except RuntimeError:
            if not self.event_loop.is_closed():
                raise

    def _handle(self, events: tuple[GpuEvent, ...]) -> None:
        for event in events:  # a bug in one is reported as the loop reports a callback's, the others handled
            try:
                self.lifecycle.handle(event)
            except Exception as error:  # noqa: BLE001
                self.event_loop.call_exception_handler({"message": f"handling {type(event).__name__} failed",
                                                        "exception": error})

    @property
    def running(self) -> bool:
        return self.event_loop.is_running()

    @property
    def reachable(self) -> bool:  # the last Redis call went through
        return self.redis_calls.reachable

    @property
    def refusing(self) -> bool:  # Redis refused a call the work waits on, lately
        return self.redis_calls.refusing

    @property
    def where(self) -> str:  # the Redis URL without its password
        return self.redis_calls.where

    @property
    def library_ok(self) -> bool:  # the server has the function library: results can be published
        return self.publisher.library.ok

    @property
    def present(self) -> bool:  # a heartbeat written: producers find this worker's model
        return self.presence.written

    @property
    def read_turn(self) -> float | None:  # the readers' beat (liveness)
        return self.intake.read_turn

    @property
    def reading_since(self) -> float | None:  # the readers have waited on Redis since then
        return self.intake.reading_since

    @property
    def inflight(self) -> int:
        return len(self.held)

    @property
    def oldest_taken(self) -> float | None:
        return self.held.oldest_taken()

    @property
    def released_at(self) -> float | None:  # when an entry was last let go
        return self.held.released_at

    def last_word(self) -> None:
        """What the stop left behind, saying only what this worker knows."""
        where, consumer, claim = self.where, self.settings.consumer_name, self.settings.claim_idle_ms
        held = len(self.held)
        if not self.redis_calls.reached:
            log.warning("stopped without ever reaching Redis at %s: this worker took no entry; what an "
                        "earlier run of consumer %s left pending there stays pending", where, consumer)
        elif held and not self.reachable:
            log.warning("stopped with Redis unreachable at %s: %d entries taken were not acknowledged; they "
                        "stay pending for consumer %s, and other workers reclaim them after %d ms", where,
                        held, consumer, claim)
        elif held:
            log.warning("stopped at the drain deadline: %d entries left pending for consumer %s; other "
                        "workers reclaim them after %d ms", held, consumer, claim)
        else:
            log.info("stopped: every entry this worker took was answered and acknowledged")

    # ---- on this thread

    def _run(self) -> None:
        asyncio.set_event_loop(self.event_loop)
        try:
            self.event_loop.run_until_complete(self._main())
        except UnsupportedServer as error:  # the same settings would fail the same way: no restart loop
            log.error("cannot serve: %s", error)
            self.fatal(2)
        # e.g. a client bug on a reconnect: the worker would never read again
        except Exception:  # noqa: BLE001
            if not self.stopping.is_set():
                log.critical("the Redis loop failed: exiting so that the supervisor restarts this worker",
                             exc_info=True)
                self.fatal(70)
            raise
        finally:
            self.event_loop.close()

    async def _main(self) -> None:
        try:
            await self.redis_calls.introduce()
            await self.intake.start()
        except REDIS_ERRORS:  # stopped before Redis ever answered: nothing was taken, nothing to settle
            return
        until_drained = [asyncio.create_task(loop()) for loop in (
            self.settler.run, self.intake.run_maintenance, self.publisher.library.watch, self.cancels.run)]
        reader = asyncio.create_task(self.intake.run_reader())  # until stopping
        while not (self.stopping.is_set() or reader.done()):
            await asyncio.sleep(0.1)
        # A read in progress ends within its BLOCK time, unless Redis does not answer: then it is abandoned
        # (what it would have delivered stays pending for this consumer: reclaimed, or re-read on restart).
        await asyncio.wait({reader}, timeout=self.settings.block_ms / 1000 + 1.0)
        reader.cancel()
        if reader.done() and not reader.cancelled() and reader.exception():
            raise reader.exception()
        while not self.drained():
            await asyncio.sleep(0.05)
        for task in until_drained:
            task.cancel()
        try:
            if self.reachable:  # best effort: a heartbeat left behind is forgotten by the others
                await asyncio.wait_for(self.presence.leave(), timeout=2.0)
            await self.redis_calls.close()
            await self.consumer.close()
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            pass
