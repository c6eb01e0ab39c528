"""Writes ops/grafana/dashboards/decision-queue.json, the provisioned Grafana dashboard of the workers' metrics.

    python ops/grafana/dashboard.py        # after changing a panel here; a test keeps the JSON equal to this output

Panels sum over the selected workers (``$instance``, among the chosen models' workers: ``$model``). Queue gauges are reported by every worker of a shard and by the
queue exporter (``dq-producer exporter``, which reports them when no worker is left) for the same streams: they are
aggregated per shard, stream and lane (``lane``) with ``max`` (never summed), then summed across shards
(``queue``); they do not follow the worker selector. Latency percentiles are of ``ok`` results: error results, answered at once, would pull them
down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "decision-queue.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
W = '{instance=~"$instance"}'  # the worker selector
RATE = "$__rate_interval"
RESULT_BYTES, RECORD_BYTES = 1350, 270  # Redis memory of one kept result and one answered record (docs/SCALING.md)
INSTANCES = 'label_values(dq_build_info{model=~"$model"}, instance)'  # the workers of the chosen models


def sel(extra: str = "") -> str:
    """A label selector for the chosen workers, plus ``extra`` matchers."""
    return '{instance=~"$instance"' + (", " + extra if extra else "") + "}"


REQUESTS, ERRORS, RECLAIMED = sel('stream="requests"'), sel('status="error"'), sel('how="reclaimed"')
OK = 'status="ok"'
HONOURED, TOO_LATE = sel('outcome="honoured"'), sel('outcome="too_late"')
FULL_PASSES = sel('generation="2"')


def queue(metric: str, by: str = "stream", extra: str = "") -> str:
    """A queue gauge: one value per shard, stream and lane (every worker of a shard and the exporter report it),
    summed across shards (and lanes, unless ``by`` names ``lane``)."""
    matchers = "{" + extra + "}" if extra else ""
    return f"sum by ({by}) (max by (shard, stream, lane) ({metric}{matchers}))" if by else \
        f"sum(max by (shard, stream, lane) ({metric}{matchers}))"


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99), extra: str = "") -> list:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{sel(extra)}[{RATE}])))",
             f"p{int(q * 100)}{suffix}") for q in qs]


class Board:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x, self.row_height = 0, 0

    def panel(self, kind: str, title: str, targets: list[tuple[str, str]], unit: str = "short", w: int = 8,
              h: int = 8, description: str = "", stack: bool = False, **options: object) -> None:
        if self.x + w > 24:
            self._newline()
        defaults: dict = {"unit": unit}
        if kind == "timeseries":
            defaults["custom"] = {"fillOpacity": 10, "showPoints": "never",
                                  "stacking": {"mode": "normal" if stack else "none"}}
        panel = {"type": kind, "title": title, "description": description, "id": len(self.panels) + 1,
                 "datasource": DATASOURCE, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
                 "fieldConfig": {"defaults": defaults, "overrides": []},
                 "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                              "legendFormat": legend} for i, (expr, legend) in enumerate(targets)],
                 "options": options or ({"legend": {"displayMode": "list", "placement": "bottom"},
                                         "tooltip": {"mode": "multi"}} if kind == "timeseries" else {})}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def gateway(b: Board) -> None:
    """The HTTP gateways (dq-gateway), all replicas together (the worker selector does not apply to them)."""
    calls, apis = "dq_gateway_requests_total", 'route=~"decide|decide_batch|requests|results|systemone|models"'
    b.row("Gateway (dq-gateway)")
    b.panel("timeseries", "Gateway calls by route and status",
            [(f"sum by (route, status) (rate({calls}{{{apis}}}[{RATE}]))", "{{route}} {{status}}")], unit="reqps",
            stack=True, w=12, description="HTTP calls answered per second: 200/202 answered, 4xx refused (401 key, "
                                           "403 lane, 413 size, 422 input, 429 full), 503 Redis, 504 late.")
    b.panel("timeseries", "Gateway latency by route",
            [(f"histogram_quantile({q}, sum by (le, route) (rate(dq_gateway_request_seconds_bucket{{{apis}}}"
              f"[{RATE}])))", f"p{int(q * 100)} {{{{route}}}}") for q in (0.5, 0.99)], unit="s", w=12,
            description="Arrival to last byte: a decide includes the queue and the model; requests is the hop.")
    b.panel("timeseries", "Gateway calls in flight", [("sum by (route) (dq_gateway_in_flight)", "{{route}}")],
            unit="short")
    b.panel("timeseries", "Requests queued through gateways, by lane",
            [(f"sum by (lane) (rate(dq_gateway_queued_requests_total[{RATE}]))", "{{lane}}")], unit="reqps",
            stack=True)
    b.panel("timeseries", "Gateway refusals and failures", [
        (f'sum by (status) (rate({calls}{{status=~"4..|5.."}}[{RATE}]))', "{{status}}")], unit="reqps", stack=True)
    b.panel("timeseries", "Gateway cancels: hang-ups and DELETE", [
        (f"sum by (reason, state) (rate(dq_gateway_cancels_total[{RATE}]))", "{{reason}} {{state}}")], unit="reqps",
        stack=True, description="Requests a gateway cancelled because their caller hung up, or on DELETE "
                                "/v1/requests, by what the cancel found (keep: a hang-up whose key or call keeps "
                                "its requests queued).")
    b.panel("timeseries", "System One calls answered by an earlier call's request",
            [(f"sum by (how) (rate(dq_gateway_calls_attached_total[{RATE}]))", "{{how}}")], unit="reqps", stack=True,
            description="retry: a client's retry (after a timeout, a dropped connection, 429 or 5xx) waited for the "
                        "request its first attempt enqueued, not computed again; identical: the same call within the "
                        "retry window (docs/GATEWAY.md, \"System One\").")


def models(b: Board) -> None:
    """One line per model (the ``model`` label of each worker's dq_build_info), side by side: several models on one
    Redis are several namespaces, each with its workers (docs/OPERATIONS.md, "Several models")."""
    join = f'on (instance) group_left (model) dq_build_info{{model=~"$model"}}'
    b.row("Models")
    b.panel("timeseries", "Workers ready by model", [(f"sum by (model) (dq_ready * {join})", "{{model}}")],
            unit="short")
    b.panel("timeseries", "Results by model", [(f"sum by (model) (rate(dq_results_total[{RATE}]) * {join})",
                                                "{{model}}")], unit="reqps", stack=True)
    b.panel("timeseries", "Tokens by model", [(f"sum by (model) (rate(dq_tokens_total[{RATE}]) * {join})",
                                               "{{model}}")], unit="short", stack=True)


def build() -> dict:
    b = Board()
    b.row("Overview")
    stat = dict(kind="stat", w=4, h=4, reduceOptions={"calcs": ["lastNotNull"], "fields": "", "values": False},
                colorMode="value", graphMode="area")
    b.panel(title="Workers ready", targets=[(f"sum(dq_ready{W})", "ready")], **stat)
    b.panel(title="Results / s", targets=[(f"sum(rate(dq_results_total{W}[{RATE}]))", "results/s")], unit="reqps",
            **stat)
    b.panel(title="Latency p95 by lane", targets=quantiles("dq_request_latency_seconds", by="lane", qs=(0.95,),
                                                           extra=OK), unit="s", **stat,
            description="Enqueue to result, ok results, per lane: includes work read into a worker but not started, "
                        "which the lag does not show.")
    b.panel(title="Queue: length and lag", targets=[(queue("dq_stream_length", by=""), "length"),
                                                    (queue("dq_stream_lag", by=""), "lag")], **stat,
            description="Length: unfinished entries (taken or not); lag: not yet taken by any worker. A length far "
                        "above the lag is work held in the workers' prefetch.")
    b.panel(title="Pack fill", targets=[(f"sum(rate(dq_pack_fill_ratio_sum{W}[{RATE}])) / "
                                         f"sum(rate(dq_pack_fill_ratio_count{W}[{RATE}]))", "fill")],
            unit="percentunit", **stat)
    b.panel(title="Errors / s", targets=[(f'sum(rate(dq_results_total{ERRORS}'
                                          f"[{RATE}]))", "errors/s")], unit="reqps", **stat)

    b.row("Throughput")
    b.panel("timeseries", "Results by status", [(f"sum by (status) (rate(dq_results_total{W}[{RATE}]))",
                                                  "{{status}}")], unit="reqps", stack=True,
            description="Requests answered per second (a fanned-out request counts once).")
    b.panel("timeseries", "Entries taken", [(f"sum by (stream, how) (rate(dq_entries_read_total{W}[{RATE}]))",
                                             "{{stream}} {{how}}")], unit="ops",
            description="Stream entries taken per second: requests and parts; read, recovered after a restart, "
                        "reclaimed from a dead worker, retried.")
    b.panel("timeseries", "Tokens through the model", [(f"sum(rate(dq_tokens_total{W}[{RATE}]))", "tokens/s"),
                                                       (f"sum by (instance) (rate(dq_tokens_total{W}[{RATE}]))",
                                                        "{{instance}}")], unit="short")
    b.panel("timeseries", "Forward passes: CUDA graph replays vs eager",
            [(f"sum by (mode) (rate(dq_packs_total{W}[{RATE}]))", "{{mode}}")], unit="ops", stack=True)
    b.panel("timeseries", "GPU busy", [(
        f"sum by (instance) (rate(dq_pack_gpu_seconds_sum{W}[{RATE}])) / (sum by (instance) "
        f"(rate(dq_pack_gpu_seconds_sum{W}[{RATE}])) + sum by (instance) (rate(dq_gpu_idle_seconds_sum{W}[{RATE}])))",
        "{{instance}}")], unit="percentunit",
        description="Share of each GPU's time spent on packs (fast engine): the rest it waited for the host to hand "
                    "over work. Low while the queue is long means the host is the bottleneck (planning, Redis).")
    b.panel("timeseries", "Fan-outs", [(f"sum(rate(dq_fanouts_total{W}[{RATE}]))", "fanned out")], unit="ops",
            description="Over-length requests split into parts that any worker takes (--fanout-tokens).")

    b.row("Latency")
    b.panel("timeseries", "End to end (enqueue to result)", [
        *quantiles("dq_request_latency_seconds", extra=OK),
        *[(expr, f"{legend} errors") for expr, legend in
          quantiles("dq_request_latency_seconds", qs=(0.95,), extra='status="error"')]], unit="s",
            description="From the stream entry id's time to the published result: ok results, and error results "
                        "apart (refused at once, they would pull the percentiles down).")
    b.panel("timeseries", "Queue wait (enqueue to taken)", quantiles("dq_queue_wait_seconds"), unit="s")
    b.panel("timeseries", "Where a request's time goes (mean per step)", [
        (f"sum(rate(dq_queue_wait_seconds_sum{W}[{RATE}])) / sum(rate(dq_queue_wait_seconds_count{W}[{RATE}]))",
         "read"),
        (f"sum by (state) (rate(dq_request_state_seconds_sum{W}[{RATE}])) / "
         f"sum by (state) (rate(dq_request_state_seconds_count{W}[{RATE}]))", "{{state}}")], unit="s", stack=True,
        w=12, description="A computed request's mean time in each step: read (enqueue to taken), planning, queued "
                          "(waiting for a pack), computing, settling (to its result published).")
    b.panel("timeseries", "Garbage collector pauses", [
        *quantiles("dq_gc_pause_seconds", qs=(0.99,)),
        (f"sum(rate(python_gc_collections_total{FULL_PASSES}[{RATE}]))", "full passes / s")], unit="s", w=12,
        description="Every thread of a worker stops while the collector runs; a full pass walks every live object "
                    "(the held entries of a backlog).")
    b.panel("timeseries", "Planning (validate, render, tokenize)", quantiles("dq_planning_seconds"), unit="s")
    b.panel("timeseries", "Forward pass by pack size", quantiles("dq_forward_seconds", by="size", qs=(0.5, 0.95)),
            unit="s", w=12, description="Launch to scores on the host, per static pack size in tokens (the CUDA-graph "
                                        "buckets; eager: none).")
    b.panel("timeseries", "Pack fill ratio", [
        (f"sum(rate(dq_pack_fill_ratio_sum{W}[{RATE}])) / sum(rate(dq_pack_fill_ratio_count{W}[{RATE}]))", "mean"),
        *quantiles("dq_pack_fill_ratio", qs=(0.5,))], unit="percentunit", w=12,
        description="Real tokens over tokens computed per pass: low fill wastes the GPU on padding.")

    b.row("Priority lanes")
    b.panel("timeseries", "End to end by lane",
            quantiles("dq_request_latency_seconds", by="lane", qs=(0.5, 0.99), extra=OK), unit="s",
            description="Enqueue to result per lane, ok results: high requests are read, planned and packed first.")
    b.panel("timeseries", "Queue wait by lane", quantiles("dq_queue_wait_seconds", by="lane", qs=(0.5, 0.99)),
            unit="s", description="Enqueue to taken by a worker, per lane: each lane has its own reader.")
    b.panel("timeseries", "Results by lane", [(f"sum by (lane) (rate(dq_request_latency_seconds_count{W}"
                                               f"[{RATE}]))", "{{lane}}")], unit="reqps", stack=True,
            description="Results published per second per lane: normal work keeps --normal-share of each pack "
                        "while it waits.")

    b.row("Queue")
    b.panel("timeseries", "Stream length (unfinished work)",
            [(queue("dq_stream_length", by="stream, lane"), "{{lane}} {{stream}}")], unit="short",
            description="Workers delete entries once answered: the length is what is left to do. All shards "
                        "together, each lane's streams.")
    b.panel("timeseries", "Lag (not yet delivered)",
            [(queue("dq_stream_lag", by="stream, lane"), "{{lane}} {{stream}}")], unit="short",
            description="The autoscaler's signal (KEDA lagCount), all shards together, each lane's streams.")
    b.panel("timeseries", "Pending (delivered, not acknowledged)",
            [(queue("dq_stream_pending", by="stream, lane"), "{{lane}} {{stream}}")], unit="short")
    b.panel("timeseries", "Lag per shard", [(queue("dq_stream_lag", by="shard"), "shard {{shard}}")], unit="short",
            description="Requests and parts not yet taken, per shard: a shard whose workers fall behind.")
    b.panel("timeseries", "In flight per worker", [(f"dq_inflight_entries{W}", "{{instance}}")], unit="short")
    b.panel("timeseries", "Dead letters waiting", [("sum by (shard) (dq_dead_letter_entries)", "shard {{shard}}")],
            unit="short", description="Entries in each shard's dead-letter stream (the queue exporter): list, "
                                      "requeue or purge them with dq-producer dead.")
    b.panel("timeseries", "Live workers (heartbeats)", [("max(dq_workers_live)", "live")], unit="short",
            description="Workers whose heartbeat in Redis is younger than 30 s, as the queue exporter reads them.")
    answered, kept = f"sum(rate(dq_results_total{W}[{RATE}]))", {k: sel(f'kind="{k}"') for k in ("result", "record")}
    b.panel("timeseries", "Redis memory held for answered requests (estimate)", [
        (f"{answered} * max(dq_retention_seconds{kept['result']}) * {RESULT_BYTES}", "results"),
        (f"{answered} * max(dq_retention_seconds{kept['record']}) * {RECORD_BYTES}", "records")],
        unit="bytes", description=f"Answered requests a second times how long each is kept (--result-ttl-s, "
        f"--record-ttl-s) times what each takes: a result about {RESULT_BYTES} bytes (at stream-node-max-bytes "
        f"1024), a record about {RECORD_BYTES}. On Redis Cluster results spread over every primary, a shard's "
        "records are its slot's, on one (docs/SCALING.md, docs/PROTOCOL.md \"Records and the shard's slot\").")

    b.row("Errors and recovery")
    b.panel("timeseries", "Error results by code",
            [(f'sum by (code) (rate(dq_results_total{ERRORS}[{RATE}]))',
              "{{code}}")], unit="reqps", stack=True)
    b.panel("timeseries", "Redeliveries, reclaims, retries, dead letters", [
        (f"sum(rate(dq_redeliveries_total{W}[{RATE}]))", "redelivered"),
        (f'sum(rate(dq_entries_read_total{RECLAIMED}[{RATE}]))', "reclaimed"),
        (f"sum(rate(dq_retries_total{W}[{RATE}]))", "retried"),
        (f"sum(rate(dq_dead_letters_total{W}[{RATE}]))", "dead-lettered"),
        (f"sum(rate(dq_lost_entries_total{W}[{RATE}]))", "lost (trimmed)")], unit="ops")
    b.panel("timeseries", "Redis errors by operation",
            [(f"sum by (op) (rate(dq_redis_errors_total{W}[{RATE}]))", "{{op}}")], unit="ops")
    b.panel("timeseries", "Cancels", [
        (f"sum(rate(dq_queue_cancels_total[{RATE}]))", "requested"),
        (f"sum(rate(dq_cancels_total{HONOURED}[{RATE}]))", "honoured (never computed)"),
        (f"sum(rate(dq_cancels_total{TOO_LATE}[{RATE}])) + "
         f'sum(rate(dq_queue_cancels_total{{found="answered"}}[{RATE}]))', "too late"),
        (f'sum(rate(dq_queue_cancels_total{{found="unknown"}}[{RATE}]))', "unknown id")], unit="ops",
        description="Requested: cancels asked of the queue (the queue exporter, from Redis). Honoured: entries "
                    "answered `cancelled` without compute (the workers). Too late: a prompt already packed, or the "
                    "request answered before the cancel. docs/OPERATIONS.md, \"Cancels\".")

    b.row("Workers")
    b.panel("timeseries", "GPU memory", [(f"dq_gpu_memory_bytes{W}", "{{instance}} {{kind}}"),
                                         (f"dq_gpu_memory_peak_bytes{W}", "{{instance}} peak")], unit="bytes",
            description="Allocated and reserved now; the peak allocation since start (not summed with them).")
    b.panel("timeseries", "Ready", [(f"dq_ready{W}", "{{instance}}")], unit="short")
    b.panel("timeseries", "Loop heartbeat age", [(f"time() - dq_loop_heartbeat_timestamp_seconds{W}",
                                                  "{{instance}} {{loop}}")], unit="s",
            description="Seconds since each loop last turned; liveness fails past 30 s.")
    b.panel("timeseries", "Process CPU (cores)", [(f"rate(process_cpu_seconds_total{W}[{RATE}])", "{{instance}}")],
            unit="short", description="CPU time per second of each worker process (the planner's processes apart).")
    b.panel("timeseries", "Process resident memory", [(f"process_resident_memory_bytes{W}", "{{instance}}")],
            unit="bytes")
    b.panel("timeseries", "Open file descriptors", [(f"process_open_fds{W}", "{{instance}}")], unit="short")
    b.panel("table", "Build and model", [(f"dq_build_info{W}", "")], w=24, h=6)
    b.panels[-1]["targets"][0].update(format="table", instant=True)

    models(b)
    gateway(b)
    return {
        "title": "Decision queue", "uid": "decision-queue", "tags": ["decision-queue"], "timezone": "",
        "editable": False, "graphTooltip": 1, "refresh": "30s", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {"text": "Prometheus", "value": "dq-prometheus"}, "hide": 0},
            {"name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
             "query": {"query": "label_values(dq_build_info, model)", "refId": "model"},
             "definition": "label_values(dq_build_info, model)", "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "hide": 0},
            {"name": "instance", "label": "Worker", "type": "query", "datasource": DATASOURCE,
             "query": {"query": INSTANCES, "refId": "instance"},
             "definition": INSTANCES, "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
