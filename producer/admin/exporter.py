"""The queue exporter (``dq-producer exporter``): the queue's depth as Prometheus metrics, read from Redis by
itself, so that alerts and dashboards see the backlog when no worker is left to report it.

It runs as the read-only ``monitor`` ACL user (counts only: XLEN, XINFO GROUPS/CONSUMERS, the heartbeat hash)
and reads on each scrape what ``dq-producer stats`` shows. Its stream gauges have the workers' names and
labels (``dq_stream_length{shard, stream, lane}``...), so the dashboard's and the alerts' ``max by (shard,
stream, lane)`` takes either source; a stream whose group does not exist yet counts as all lag (nobody took
anything).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

import redis

from ..plumbing.endpoints import NOT_FOUND, Answer, serve_paths
from ..plumbing.exits import OK
from ..wire.errors import DecisionQueueError

log = logging.getLogger("producer.exporter")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STREAM_GAUGES = {  # name: (the stats field, help)
    "dq_stream_length": ("length", "Entries in the stream (unfinished work)"),
    "dq_stream_pending": ("pending", "Entries delivered and not acknowledged"),
    "dq_stream_lag": ("lag", "Entries not yet delivered to any worker"),
    "dq_stream_consumers": ("consumers", "Group consumers seen lately or holding entries"),
}
OTHER_GAUGES = {
    "dq_dead_letter_entries": "Entries in the shard's dead-letter stream",
    "dq_workers_live": "Workers whose heartbeat is younger than 30 s",
    "dq_exporter_redis_up": "1 when the last read of the queue from Redis succeeded",
    "dq_exporter_read_seconds": "How long the last read of the queue took",
}
CANCELS = ("dq_queue_cancels_total", "Cancels asked of the shard, by what each found: queued (never computed), "
           "held (a worker decides), answered (too late) or unknown")  # a counter, kept in Redis
# Every series this exporter can write -> its labels (tests check the dashboard's and the alerts' names against
# it).
EXPORTED = {**{name: ("shard", "stream", "lane") for name in STREAM_GAUGES},
            "dq_dead_letter_entries": ("shard",),
            **{name: () for name in OTHER_GAUGES if name != "dq_dead_letter_entries"},
            CANCELS[0]: ("shard", "found")}


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{name}="{value}"' for name, value in labels.items()) + "}" if labels else ""


def render(stats: dict[str, Any] | None, seconds: float) -> str:
    """The exposition text of one read (``Client.stats()``'s dict; None: Redis did not answer)."""
    samples: dict[str, list[str]] = {name: [] for name in (*STREAM_GAUGES, *OTHER_GAUGES)}
    cancels: list[str] = []
    for shard in (stats or {}).get("shards", []):
        for lane, streams in shard["lanes"].items():
            for stream, figures in streams.items():
                # no group yet: nothing was delivered, everything waits
                values = {"pending": 0, "lag": figures["length"], "consumers": 0, **figures}
                for name, (field, _) in STREAM_GAUGES.items():
                    samples[name].append(f"{name}{_labels(shard=shard['shard'], stream=stream, lane=lane)} "
                                         f"{values[field]}")
        samples["dq_dead_letter_entries"].append(f"dq_dead_letter_entries{_labels(shard=shard['shard'])} "
                                                 f"{shard['dead_letters']}")
        cancels += [f"{CANCELS[0]}{_labels(shard=shard['shard'], found=found)} {count}"
                    for found, count in shard.get("cancels", {}).items()]
    if stats is not None:
        samples["dq_workers_live"].append(f"dq_workers_live {stats['workers']}")
    samples["dq_exporter_redis_up"].append(f"dq_exporter_redis_up {0 if stats is None else 1}")
    samples["dq_exporter_read_seconds"].append(f"dq_exporter_read_seconds {seconds:.6f}")
    out = []
    for name, lines in samples.items():
        text = STREAM_GAUGES[name][1] if name in STREAM_GAUGES else OTHER_GAUGES[name]
        out += [f"# HELP {name} {text}", f"# TYPE {name} gauge", *lines]
    name = CANCELS[0].removesuffix("_total")
    out += [f"# HELP {name} {CANCELS[1]}", f"# TYPE {name} counter", *cancels]
    return "\n".join(out) + "\n"


class Exporter:
    """Reads the queue once per scrape (one at a time: concurrent scrapes share the read in progress)."""

    def __init__(self, read: Callable[[], dict[str, Any]], where: str) -> None:
        self.read, self.where = read, where
        self.lock = threading.Lock()
        self.failing = False

    def metrics(self) -> str:
        with self.lock:
            start = time.monotonic()
            try:
                stats: dict[str, Any] | None = self.read()
                if self.failing:
                    log.warning("queue at %s readable again", self.where)
                self.failing = False
            except (redis.RedisError, DecisionQueueError) as error:
                if not self.failing:  # one line per outage, not one per scrape
                    log.warning("cannot read the queue at %s: %s", self.where, error)
                stats, self.failing = None, True
            return render(stats, time.monotonic() - start)


def serve(exporter: Exporter, host: str, port: int) -> ThreadingHTTPServer:
    """``/metrics`` (the queue), ``/healthz`` (the exporter runs); in a thread."""

    def answer(path: str) -> Answer:
        if path == "/metrics":
            return 200, exporter.metrics().encode(), CONTENT_TYPE
        return (200, b"ok\n", "text/plain") if path in ("/healthz", "/health") else NOT_FOUND

    return serve_paths(host, port, answer, "exporter-http")


def run(args: argparse.Namespace, client: Any) -> int:
    """``dq-producer exporter``: serve until SIGTERM or SIGINT; Redis need not answer at start (it is
    reported)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = serve(Exporter(client.stats, client.deployment.safe_url), args.host, args.port)
    host, port = server.server_address[:2]
    log.info("serving the queue of namespace %s (%d shards) at %s as /metrics", client.deployment.namespace,
             client.shards, f"http://{'[' + host + ']' if ':' in host else host}:{port}")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return OK


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    exp = commands.add_parser(
        "exporter", parents=[common], help="serve the queue's depth as Prometheus metrics",
        description="Serve /metrics: each shard's and lane's stream lengths, pending, lag and consumers, dead "
                    "letters and live workers, read from Redis at each scrape (the monitor ACL user is enough). "
                    "docs/OPERATIONS.md lists the metrics.")
    exp.add_argument("--port", type=int, default=9401, metavar="PORT", help="port to serve on [default 9401]")
    exp.add_argument("--host", default="", metavar="ADDRESS",
                     help="address to bind (IPv4 or IPv6) [default '': every interface, IPv6 and IPv4]")
    exp.set_defaults(run=run)
