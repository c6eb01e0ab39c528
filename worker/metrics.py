"""Prometheus metrics of one worker process, defined once: prefix ``dq_``, base units, few labels, no ids.

Queue gauges carry the worker's ``shard``: every worker of a shard reports the same value, so dashboards and
alerts take ``max by (shard, stream, lane)`` and then sum across shards. ``lane`` is the lane (high, normal)
of the stream an entry came from: latency, queue wait and the stream gauges carry it (the gateway's metrics
name it the same). Labelled counters start at zero for every known label value, so a panel shows a flat line
rather than no data until the first event. The process and Python collectors (``process_*``, ``python_*``)
come with the registry.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from producer.plumbing.supported import lag_of
from producer.wire.keys import LANES
from producer.wire.schema import ErrorCode

from .entries import Stream
from .tasks import State

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5, 10, 30)
STATE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
PAUSE_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 2)
# a computed entry's, after its take
STATES = tuple(state.value for state in State if state is not State.TAKEN)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
STREAMS = ("requests", "chunks")
TAKEN = ("read", "recovered", "reclaimed", "retried")
STATUSES = ("ok", "error")
# No ``_created`` series beside each counter and histogram (process-wide): no alert or panel reads them, and
# they doubled the counters' series.
disable_created_metrics()
REDIS_OPS = ("create groups", "read", "get body", "look up", "fan out", "claim", "dead letter",
             "ack", "publish", "reply", "maintenance", "take", "cancels", "record")


class Metrics:
    """The worker's Prometheus metrics, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None, shard: int = 0) -> None:
        self.registry = registry or CollectorRegistry()
        self.shard = str(shard)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.entries = Counter("dq_entries_read_total", "Stream entries taken by this worker",
                               ["stream", "how"], registry=r)
        self.results = Counter("dq_results_total", "Results published, by status and error code",
                               ["status", "code"], registry=r)
        self.entries_ahead = Counter("dq_entries_ahead_total",
                                     "Entries whose enqueue time (entry id) was ahead of "
                                     "the worker's clock: a producer-chosen id or clock skew",
                                     ["stream"], registry=r)
        self.redeliveries = Counter("dq_redeliveries_total",
                                    "Entries taken that were delivered before", ["stream"], registry=r)
        self.dead_letters = Counter("dq_dead_letters_total",
                                    "Entries moved to the dead-letter stream", registry=r)
        self.retries = Counter("dq_retries_total",
                               "Entries retried after their forward pass failed", registry=r)
        self.fanouts = Counter("dq_fanouts_total", "Over-length requests fanned out as parts", registry=r)
        self.planner_crashes = Counter("dq_planner_crashes_total",
                                       "Planner processes that died (their pool was "
                                       "replaced and their entries planned again)", registry=r)
        self.reused_ids = Counter("dq_reused_ids_total", "Requests whose id was answered before, not "
                                  "computed: replay (the same request) or conflict (another)",
                                  ["outcome"], registry=r)
        self.cancels = Counter("dq_cancels_total", "Cancels of requests this worker took: honoured (answered "
                               "cancelled, never computed) or too_late (a prompt already packed, or it was "
                               "being answered: answered as it was)", ["outcome"], registry=r)
        for outcome in ("honoured", "too_late"):
            self.cancels.labels(outcome)
        self.lost = Counter("dq_lost_entries_total",
                            "Pending entries whose payload was gone (trimmed)", registry=r)
        self.unreadable_results = Counter("dq_unreadable_results_total",
                                          "Entries whose id holds a result no worker "
                                          "wrote (not a result of that id): dead-lettered", registry=r)
        self.unread_deleted = Counter("dq_unread_entries_deleted_total",
                                      "Times entries of a work stream were found "
                                      "deleted before the group read them (a trim: requests lost unanswered)",
                                      ["stream", "lane"], registry=r)
        for stream in Stream:  # from zero: the alerts' increase() sees the first one
            self.entries_ahead.labels(stream)
            for lane in LANES:
                self.unread_deleted.labels(stream, lane)
        self.groups_recreated = Counter("dq_groups_recreated_total",
                                        "Consumer groups recreated because Redis lost them", registry=r)
        self.redis_errors = Counter("dq_redis_errors_total", "Failed Redis calls, by operation",
                                    ["op"], registry=r)
        self.pool_timeouts = Counter("dq_redis_pool_timeouts_total", "Redis calls that waited the pool's whole "
                                     "timeout for a free connection, all in use (the worker's own calls): not "
                                     "Redis down, and not in dq_redis_errors_total", registry=r)
        self.not_durable = Counter("dq_not_durable_total", "Durable mode: writes fewer replicas than "
                                   "--wait-replicas confirmed in time (retried), by operation",
                                   ["op"], registry=r)
        self.not_durable.labels("publish")  # from zero: the alert's increase() sees the first one
        self.latency = Histogram("dq_request_latency_seconds",
                                 "Enqueue (stream entry id) to result published, by result status and lane",
                                 ["status", "lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("dq_queue_wait_seconds", "Enqueue to first taken by a worker, by lane",
                                    ["lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.states = Histogram("dq_request_state_seconds", "Time a computed entry spent in each state after "
                                "it was taken: planning (to its prompts queued), queued (waiting for a "
                                "pack), computing (its packs on the GPU, to its answers read out), settling "
                                "(to its result published); with dq_queue_wait_seconds before them, where "
                                "its latency went", ["state", "lane"],
                                buckets=STATE_BUCKETS, registry=r)
        self.planning = Histogram("dq_planning_seconds", "Validate, render and tokenize one entry",
                                  buckets=FORWARD_BUCKETS, registry=r)
        self.forward = Histogram("dq_forward_seconds", "One forward pass, launch to scores on the host, by "
                                 "static pack size in tokens (eager: none)", ["size"],
                                 buckets=FORWARD_BUCKETS, registry=r)
        self.pack_gpu = Histogram("dq_pack_gpu_seconds", "One pack's own time on the GPU",
                                  buckets=FORWARD_BUCKETS, registry=r)
        self.gc_pause = Histogram("dq_gc_pause_seconds", "One pass of Python's garbage collector, any "
                                  "generation: every thread of the worker stops meanwhile",
                                  buckets=PAUSE_BUCKETS, registry=r)
        self.launch = Histogram("dq_pack_launch_seconds", "One pack's launch on the host (layout, copies, "
                                "kernels enqueued): a pack launched behind a running one runs stretched if its "
                                "launch ends after that one", buckets=PAUSE_BUCKETS, registry=r)
        self.gpu_idle = Histogram("dq_gpu_idle_seconds",
                                  "GPU idle between the previous pack's end and a pack's start",
                                  buckets=FORWARD_BUCKETS, registry=r)
        self.fill = Histogram("dq_pack_fill_ratio", "Real tokens / tokens computed, per pack",
                              buckets=FILL_BUCKETS, registry=r)
        self.tokens = Counter("dq_tokens_total", "Prompt tokens through the model", registry=r)
        self.prompts = Counter("dq_prompts_total", "Prompts through the model (computed)", registry=r)
        self.packs = Counter("dq_packs_total", "Forward passes, replayed CUDA graphs or eager",
                             ["mode"], registry=r)
        self.retention = Gauge("dq_retention_seconds", "How long Redis keeps what this worker writes for an "
                               "answered request: its result (kind result, --result-ttl-s) and its record (kind "
                               "record, --record-ttl-s): with the result rate, Redis memory", ["kind"], registry=r)
        self.gpu_memory = Gauge("dq_gpu_memory_bytes",
                                "GPU memory of this process now: allocated or reserved", ["kind"], registry=r)
        self.gpu_memory_peak = Gauge("dq_gpu_memory_peak_bytes",
                                     "Most GPU memory this process has had allocated", registry=r)
        self.stream_length = Gauge("dq_stream_length", "Entries in the stream (unfinished work)",
                                   ["shard", "stream", "lane"], registry=r)
        self.stream_pending = Gauge("dq_stream_pending", "Entries delivered and not acknowledged",
                                    ["shard", "stream", "lane"], registry=r)
        self.stream_lag = Gauge("dq_stream_lag", "Entries not yet delivered to any worker",
                                ["shard", "stream", "lane"],
                                registry=r)
        self.inflight = Gauge("dq_inflight_entries", "Entries this worker holds", registry=r)
        self.heartbeat = Gauge("dq_loop_heartbeat_timestamp_seconds", "Last turn of each loop",
                               ["loop"], registry=r)
        self.ready = Gauge("dq_ready", "1 once the model is loaded, graphs captured and Redis reached, by "
                           "the shard this worker reads", ["shard"], registry=r)
        self.info = Gauge("dq_build_info", "Version, model, engine, device, shard and deterministic mode "
                          "(true or false) of this worker",
                          ["version", "model", "engine", "device", "shard", "deterministic"], registry=r)
        for stream in STREAMS:
            self.redeliveries.labels(stream)
            for how in TAKEN:
                self.entries.labels(stream, how)
        self.results.labels("ok", "")
        for code in ErrorCode:
            self.results.labels("error", code.value)
        for op in REDIS_OPS:
            self.redis_errors.labels(op)
        for lane in LANES:
            self.queue_wait.labels(lane)
            for state in STATES:
                self.states.labels(state, lane)
            for status in STATUSES:
                self.latency.labels(status, lane)
        self.ready.labels(self.shard).set(0)

    @contextlib.contextmanager
    def collector_pauses(self) -> Iterator[None]:
        """Each pass of the garbage collector meanwhile timed into ``dq_gc_pause_seconds`` (a ``gc.callbacks``
        entry)."""
        pauses = CollectorPauses(self.gc_pause)
        gc.callbacks.append(pauses)
        try:
            yield
        finally:
            gc.callbacks.remove(pauses)

    def streams(self, stats: dict[tuple[str, str], dict[str, Any]]) -> None:
        """The group stats of this worker's shard (``{(stream, lane): {length, pending, lag}}``; lag None: not
        counted by the server, so the length less pending, see ``lag_of``)."""
        for (stream, lane), st in stats.items():
            self.stream_length.labels(self.shard, stream, lane).set(st["length"])
            self.stream_pending.labels(self.shard, stream, lane).set(st["pending"])
            lag = lag_of(st["length"], st["pending"], st["lag"])
            self.stream_lag.labels(self.shard, stream, lane).set(lag)

    def set_ready(self, ready: bool) -> None:
        self.ready.labels(self.shard).set(1 if ready else 0)

    def built(self, version: str, model: str, engine: str, device: str, deterministic: bool) -> None:
        self.info.labels(version, model, engine, device, self.shard, str(deterministic).lower()).set(1)

    def retains(self, result_s: int, record_s: int) -> None:
        self.retention.labels("result").set(result_s)
        self.retention.labels("record").set(record_s)


class CollectorPauses:
    """Times each pass of the garbage collector (a ``gc.callbacks`` entry; passes never overlap: they hold the
    GIL)."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.began: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif self.began is not None:
            self.histogram.observe(time.perf_counter() - self.began)
            self.began = None
