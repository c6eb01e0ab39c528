"""The gateway's metrics, in a registry of its own (a process may hold others): calls by route, lane and
status, their latency, calls and connections in flight, connections closed at a limit, requests queued, System
One calls answered by an earlier call's request, cancels, Redis failures, pool waits that timed out.
docs/GATEWAY.md, "Metrics", lists them; the front layer (front/layer.py) counts the calls,
front/connections.py the connections, front/redis_failures.py the Redis failures, the routes the rest.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from .. import __version__

# No ``_created`` series beside each counter and histogram (process-wide): no alert or panel reads them, and
# they doubled the counters' series (worker/metrics.py does the same).
disable_created_metrics()
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Why the gateway closed a connection at a limit (front/connections.py).
CLOSED_REASONS = ("header_timeout", "header_too_large", "over_limit", "idle_evicted", "slow_evicted",
                  "invalid_request")
ATTACHED = ("System One calls answered by a request an earlier call enqueued: a client's retry, or an "
            "identical call within the retry window")
CANCELS = ("requests the gateway cancelled, by why (hang_up: the caller went away; delete: DELETE "
           "/v1/requests) and what the cancel found (keep: a hang-up whose key or call keeps its requests)")

REDIS_ERROR_KINDS = ("unreachable", "refused", "not_durable")  # dq_gateway_redis_errors_total's kinds
REDIS_ERRORS = ("Redis failures the gateway's calls met, by kind (unreachable: not reached or no answer in time; "
                "refused; not_durable: replicas did not confirm); logged once per outage (front/redis_failures.py)")
POOL_TIMEOUTS = ("Redis calls that waited the pool's whole timeout for a free connection, every one in use by "
                 "the gateway's own calls (not Redis down: not in dq_gateway_redis_errors_total)")


class Metrics:
    """The gateway's own registry (a process may hold others)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.calls = Counter("dq_gateway_requests", "HTTP calls answered, by route, lane and status",
                             ["route", "lane", "status"], registry=registry)
        self.seconds = Histogram("dq_gateway_request_seconds",
                                 "time from a call's arrival to its last byte, by route and lane",
                                 ["route", "lane"], buckets=BUCKETS, registry=registry)
        self.in_flight = Gauge("dq_gateway_in_flight", "HTTP calls being answered, by route", ["route"],
                               registry=registry)
        self.queued = Counter("dq_gateway_queued_requests", "requests the gateway put on the queue, by lane",
                              ["lane"], registry=registry)
        self.connections = Gauge("dq_gateway_connections", "HTTP connections open", registry=registry)
        self.closed = Counter("dq_gateway_connections_closed",
                              "HTTP connections the gateway closed at a limit, by reason (connections.py)",
                              ["reason"], registry=registry)
        for reason in CLOSED_REASONS:  # from zero: an alert's increase() sees the first one
            self.closed.labels(reason)
        self.attached = Counter("dq_gateway_calls_attached", ATTACHED, ["how"], registry=registry)
        self.build = Gauge("dq_gateway_build_info", "always 1: the version this gateway runs", ["version"],
                           registry=registry)
        self.build.labels(__version__).set(1)
        self.redis_errors = Counter("dq_gateway_redis_errors", REDIS_ERRORS, ["kind"], registry=registry)
        for kind in REDIS_ERROR_KINDS:
            self.redis_errors.labels(kind)  # from zero: the alert's rate() sees the first one
        self.pool_timeouts = Counter("dq_gateway_redis_pool_timeouts", POOL_TIMEOUTS, registry=registry)
        self.cancels = Counter("dq_gateway_cancels", CANCELS, ["reason", "state"], registry=registry)
        for reason, state in (("hang_up", "cancelled"), ("hang_up", "cancelling"), ("hang_up", "keep"),
                              ("delete", "cancelled"), ("delete", "cancelling"), ("delete", "too_late")):
            self.cancels.labels(reason, state)  # from zero: a panel shows a flat line, not no data
