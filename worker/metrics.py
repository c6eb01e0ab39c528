"""Prometheus metrics of one worker process, defined once: prefix ``dq_``, base units, few labels, no ids.

``priority`` is the lane (high, normal) of the stream an entry came from: latency, queue wait and the stream gauges
carry it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5, 10, 30)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.entries = Counter("dq_entries_read_total", "Stream entries taken by this worker", ["stream", "how"],
                               registry=r)
        self.results = Counter("dq_results_total", "Results published, by status and error code",
                               ["status", "code"], registry=r)
        self.redeliveries = Counter("dq_redeliveries_total", "Entries taken that were delivered before", ["stream"],
                                    registry=r)
        self.dead_letters = Counter("dq_dead_letters_total", "Entries moved to the dead-letter stream", registry=r)
        self.retries = Counter("dq_retries_total", "Entries retried after their forward pass failed", registry=r)
        self.fanouts = Counter("dq_fanouts_total", "Over-length requests fanned out as parts", registry=r)
        self.lost = Counter("dq_lost_entries_total", "Pending entries whose payload was gone (trimmed)", registry=r)
        self.groups_recreated = Counter("dq_groups_recreated_total",
                                        "Consumer groups recreated because Redis lost them", registry=r)
        self.redis_errors = Counter("dq_redis_errors_total", "Failed Redis calls, by operation", ["op"], registry=r)
        self.latency = Histogram("dq_request_latency_seconds", "Enqueue (stream entry id) to result published, by lane",
                                 ["priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("dq_queue_wait_seconds", "Enqueue to first taken by a worker, by lane",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.planning = Histogram("dq_planning_seconds", "Validate, render and tokenize one entry",
                                  buckets=FORWARD_BUCKETS, registry=r)
        self.forward = Histogram("dq_forward_seconds", "One forward pass, launch to scores on the host", ["bucket"],
                                 buckets=FORWARD_BUCKETS, registry=r)
        self.pack_gpu = Histogram("dq_pack_gpu_seconds", "One pack's own time on the GPU", buckets=FORWARD_BUCKETS,
                                  registry=r)
        self.gpu_idle = Histogram("dq_gpu_idle_seconds", "GPU idle between the previous pack's end and a pack's start",
                                  buckets=FORWARD_BUCKETS, registry=r)
        self.fill = Histogram("dq_pack_fill_ratio", "Real tokens / tokens computed, per pack", buckets=FILL_BUCKETS,
                              registry=r)
        self.tokens = Counter("dq_tokens_total", "Prompt tokens through the model", registry=r)
        self.packs = Counter("dq_packs_total", "Forward passes, replayed CUDA graphs or eager", ["mode"], registry=r)
        self.gpu_memory = Gauge("dq_gpu_memory_bytes", "GPU memory of this process", ["kind"], registry=r)
        self.stream_length = Gauge("dq_stream_length", "Entries in the stream (unfinished work)",
                                   ["stream", "priority"], registry=r)
        self.stream_pending = Gauge("dq_stream_pending", "Entries delivered and not acknowledged",
                                    ["stream", "priority"], registry=r)
        self.stream_lag = Gauge("dq_stream_lag", "Entries not yet delivered to any worker", ["stream", "priority"],
                                registry=r)
        self.inflight = Gauge("dq_inflight_entries", "Entries this worker holds", registry=r)
        self.heartbeat = Gauge("dq_loop_heartbeat_timestamp_seconds", "Last turn of each loop", ["loop"], registry=r)
        self.ready = Gauge("dq_ready", "1 once the model is loaded, graphs captured and Redis reached", registry=r)
        self.info = Gauge("dq_build_info", "Version, model and engine of this worker",
                          ["version", "model", "engine", "device"], registry=r)
