"""dq-producer (or python -m producer): submit a JSONL file of requests and wait for their results, print one
result, cancel requests or say where they are, or show queue stats.

  dq-producer submit requests.jsonl                      one line per request: {"line": N, "id": ...}
  dq-producer submit requests.jsonl --wait --ordered     one result per request line, in input order
  dq-producer submit urgent.jsonl --priority high        the high lane, for lines that do not say
  dq-producer submit r.jsonl --model decider-b --model-namespaces decider-a,decider-b     to a model's workers
  dq-producer result ID --wait 30
  dq-producer cancel ID... | --file ids.txt              one line per id: cancelled, cancelling, too_late, unknown
  dq-producer status ID... | --file ids.txt              one line per id: queued, in_progress, answered, ...
  dq-producer stats [--watch 2] [--json]               the streams and workers as tables (--json: the figures)
  dq-producer dead list | requeue ID... | purge --all    dead letters (the admin user)
  dq-producer exporter --port 9401                       queue depth as Prometheus metrics (the monitor user)

Exit codes: 0 every request queued (or, with --wait, answered ok); 1 some refused, answered with an error or
timed out (cancel: one too late; status: one unknown); 2 usage (bad flag, file, URL or id; a --model no live
worker serves) or an unsupported server (older than Redis 7.0 or Valkey 7.2); 3 queue full, some requests not
sent; 4 Redis unreachable or refusing; 130 interrupted (Ctrl-C: every line still gets its record).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .. import __version__
from ..admin import dead_letters, exporter
from ..client import (Client, LibraryUnavailable, ModelNotServed, NotDurable, QueueFull, ResultTimeout,
                      UnsupportedServer)
from ..plumbing.connection import Deployment, check_reachable
from ..plumbing.exits import FAILED, INTERRUPTED, OK, UNREACHABLE, USAGE
from ..wire.keys import GONE_S, LANES, PROTOCOL
from ..wire.schema import ErrorCode
from . import control, table
from .submission import Line, Report, read_lines



def submit(args: argparse.Namespace, client: Client) -> int:
    lines: list[Line] = args.lines
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.output is None else stack.enter_context(args.output)
        report = Report(lines, out, args.quiet)
        report.refusals()
        try:
            _send(client, lines, report, args)
            if args.wait:
                _wait(client, lines, report, args)
        except KeyboardInterrupt:
            return report.interrupted(args.wait, args.ordered)
        if not args.wait:
            for line in lines:
                out.write(json.dumps(line.receipt()) + "\n")
        return report.summary(waited=args.wait)


def _send(client: Client, lines: list[Line], report: Report, args: argparse.Namespace) -> None:
    """Enqueue in windows of ``--batch``; while the queue is full, retry for up to ``--queue-timeout`` seconds
    without progress, then mark the rest not sent."""
    todo = [line for line in lines if line.state == "read"]
    for start in range(0, len(todo), args.batch):
        window = todo[start: start + args.batch]
        stalled_since, delay = time.monotonic(), 0.05
        while window:
            report.sending, full = window, None  # interrupted in the call, these may or may not be queued
            try:
                client.submit_many([line.prepared for line in window])
                accepted = Counter(line.id for line in window)
            except QueueFull as error:
                accepted, full = Counter(error.accepted), error
            except NotDurable as error:  # enqueued on the primary, not confirmed: the same ids sent again
                accepted, full = Counter(), error
            for line in window:
                if accepted[line.id] > 0:
                    accepted[line.id] -= 1
                    line.state = "queued"
            window, report.sending = [line for line in window if line.state == "read"], []
            report.progress()
            if full is None:
                continue
            if getattr(full, "accepted", None):
                stalled_since = time.monotonic()
            elif time.monotonic() - stalled_since >= args.queue_timeout:
                what = "queue full" if isinstance(full, QueueFull) else "replicas not confirming"
                why = f"{what} for {args.queue_timeout:g} s ({getattr(full, 'detail', full)})"
                for line in window + todo[start + args.batch:]:
                    line.fail("not_sent", ErrorCode.NOT_SENT, why)
                report.note(f"{why}: {report.count('not_sent')} requests not sent")
                return
            time.sleep(delay)  # backpressure: wait for the workers to drain the stream
            delay = min(delay * 2, 2.0)


def _wait(client: Client, lines: list[Line], report: Report, args: argparse.Namespace) -> None:
    """Collect results until all are there or ``--timeout`` passes; the missing ones get a ``timeout``
    result."""
    for line in lines:
        if line.state in ("refused", "not_sent"):
            report.write(line, args.ordered)
    deadline = report.waiting_since = time.monotonic()
    deadline += args.timeout
    if any(line.state == "queued" for line in lines):
        _no_worker_warning(client, args.timeout, report.note)
    waiting = [line for line in lines if line.state == "queued"]
    while waiting:
        window = waiting[:1000]
        try:
            # As stored: each line is checked against its own request below (one id may be on several lines).
            landed = client.wait_many([line.id for line in window],
                                      timeout=min(2.0, max(0.0, deadline - time.monotonic())), check=False)
        except ResultTimeout as partial:
            landed = partial.results
        for line in window:
            # Another request's result under a reused id (or a line's twin) is a conflict.
            if line.id in landed:
                line.state, line.result = "answered", line.prepared.answered_by(landed[line.id])
                report.write(line, args.ordered)
        waiting = [line for line in waiting if line.state == "queued"]
        report.progress()
        if waiting and time.monotonic() >= deadline:
            for line in waiting:
                line.fail("timed_out", ErrorCode.TIMEOUT, f"no result within {args.timeout:g} s; the request "
                                                          f"stays queued (dq-producer result {line.id})")
                report.write(line, args.ordered)
            report.note(f"{len(waiting)} results missing after {args.timeout:g} s; they can be read later "
                        f"(dq-producer result ID)")
            return


def _no_worker_warning(client: Client, timeout: float, say: Any) -> None:
    """Say at once when no worker is alive to answer (or the namespace is mistyped): the wait may be long."""
    if client.live_workers() == 0:
        say(f"dq-producer: no live worker in namespace {client.keys.namespace!r} (no heartbeat in the last "
            f"{GONE_S} s; is the namespace right?): requests stay queued until one starts; waiting up to "
            f"{timeout:g} s")


def stats(args: argparse.Namespace, client: Client) -> int:
    def shown() -> str:
        found = client.stats()
        if args.json:
            return json.dumps(found, indent=2, default=str) + "\n"
        return table.render(found, client.deployment.namespace)

    if args.watch is None:
        sys.stdout.write(shown())
        return OK
    try:
        table.watch(shown, args.watch)
    except KeyboardInterrupt:  # how a watch ends
        pass
    return OK


def result(args: argparse.Namespace, client: Client) -> int:
    try:
        found = client.fetch(args.id)
        if found is None and args.wait:
            _no_worker_warning(client, args.wait, lambda text: print(text, file=sys.stderr))
            found = client.wait(args.id, args.wait)
    except ResultTimeout:
        found = None
    if found is None:
        print(f"dq-producer: no result for {args.id}" + (f" within {args.wait:g} s" if args.wait else ""),
              file=sys.stderr)
        return FAILED
    print(found.model_dump_json(exclude_none=True, indent=2))
    return OK if found.ok else FAILED


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dq-producer", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version",
                     version=f"dq-producer {__version__} (decision-queue, wire protocol v{PROTOCOL})")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    defaults = Deployment()
    for name, (flags, metavar, text) in Deployment.FLAGS.items():
        default, env = getattr(defaults, name), Deployment.ENV[name]
        kind: dict[str, Any] = ({"action": "store_true"} if isinstance(default, bool)
                                else {"type": int, "metavar": metavar} if isinstance(default, int)
                                else {"metavar": metavar})
        shown = ("on" if default else "off") if isinstance(default, bool) else repr(default)
        common.add_argument(*flags, dest=name, default=None, help=f"{text} [env {env}, default {shown}]",
                            **kind)
    routed = argparse.ArgumentParser(add_help=False, parents=[common])  # where requests go: by model
    routed.add_argument("--model", default=None, metavar="NAME",
                        help="the model to use: the first of --model-namespaces whose live workers serve it "
                             "(exit 2 if none does) [default: the namespace's]")
    routed.add_argument("--model-namespaces", default=None, metavar="NS,NS",
                        help="the namespaces where --model is looked for, in order [default: --namespace]")

    sub = commands.add_parser("submit", parents=[routed], help="submit a JSONL file, one request per line",
                              description="Submit a JSONL file, one request per line (blank lines are "
                                          "skipped).")
    sub.add_argument("file", help="JSONL file, or - for stdin")
    sub.add_argument("--wait", action="store_true",
                     help="wait and write one result per request line (else one {line, id} record) "
                          "[default off]")
    sub.add_argument("--ordered", action="store_true",
                     help="with --wait, write results in input order instead of as they land [default off]")
    sub.add_argument("--out", default="-", metavar="FILE",
                     help="where the records or results go [default '-': stdout]")
    sub.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                     help="seconds to wait for the results; the missing ones get a timeout result "
                          "[default 600]")
    sub.add_argument("--queue-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="seconds to keep retrying while the queue is full and nothing gets in; then the rest "
                          "is not sent and the exit code is 3 (0: give up at once) [default 60]")
    sub.add_argument("--batch", type=_positive, default=500, metavar="N",
                     help="requests per submit call [default 500]")
    sub.add_argument("--max-unfinished", type=_at_least_zero, default=100_000, metavar="N",
                     help="backpressure: the most entries a shard's request stream may hold (0: no limit) "
                          "[default 100000]")
    sub.add_argument("--priority", choices=[str(lane) for lane in LANES], default=None,
                     help="the lane of requests whose line has no \"priority\": high requests are served "
                          "ahead of the normal backlog [default: normal]")
    sub.add_argument("--quiet", action="store_true",
                     help="no progress line (the summary stays) [default off]")
    sub.set_defaults(run=submit)

    stat = commands.add_parser(
        "stats", parents=[common], help="the queue's streams and workers, as tables",
        description="Stream lengths, the worker group's pending, lag and consumers, for each shard and lane "
                    "(high, normal) and every shard together; dead letters; and each worker's heartbeat (name, "
                    "shard, model, engine, state, entries held, last beat).")
    stat.add_argument("--json", action="store_true",
                      help="the figures as JSON (per lane and both lanes together, per shard and in total) "
                           "[default off: tables]")
    stat.add_argument("--watch", type=table.interval, default=None, metavar="SECONDS",
                      help="draw the tables again every SECONDS until Ctrl-C [default off: once]")
    stat.set_defaults(run=stats)

    res = commands.add_parser(
        "result", parents=[routed], help="print one result (exit 1 for an error or none)",
        description="Print one request's result; exit 0 if it is ok, 1 if it is an error result or there is "
                    "none.")
    res.add_argument("id", help="the request id")
    res.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                     help="seconds to wait for it (0: look once) [default 0]")
    res.set_defaults(run=result)
    control.add_parsers(commands, common)
    dead_letters.add_parser(commands, common)
    exporter.add_parser(commands, common)
    return top


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # everything that can be wrong before a byte is sent
        deployment = Deployment.resolve(**{name: getattr(args, name) for name in Deployment.FLAGS})
        if args.command == "submit":
            with sys.stdin.buffer if args.file == "-" else open(args.file, "rb") as handle:
                args.lines = read_lines(handle, args.priority)
            args.output = None if args.out == "-" else open(args.out, "w", encoding="utf-8")
    except (ValueError, OSError) as error:
        print(f"dq-producer: {error}", file=sys.stderr)
        return USAGE
    # The exporter starts whatever Redis does (it reports it), reading without retries: a scrape never waits
    # them.
    options = {"retry": Retry(NoBackoff(), 0)} if args.command == "exporter" else {}
    try:
        if args.command != "exporter":
            check_reachable(deployment)
        namespaces = [n for n in (getattr(args, "model_namespaces", None) or "").split(",") if n]
        with Client(deployment.url, deployment.namespace, cluster=deployment.cluster,
                    shards=deployment.shards, wait_replicas=deployment.wait_replicas,
                    max_unfinished=getattr(args, "max_unfinished", 0),
                    model=getattr(args, "model", None), model_namespaces=namespaces,
                    **deployment.options(), **options) as client:
            return args.run(args, client)
    except redis.RedisError as error:
        print(f"dq-producer: Redis at {deployment.safe_url}: {error}", file=sys.stderr)
        return UNREACHABLE
    except (UnsupportedServer, ModelNotServed) as error:  # an old server; a --model no live worker serves
        print(f"dq-producer: {error}", file=sys.stderr)
        return USAGE
    except LibraryUnavailable as error:  # refusing: the library is missing and this user may not load it
        print(f"dq-producer: Redis at {deployment.safe_url}: {error}", file=sys.stderr)
        return UNREACHABLE
    except KeyboardInterrupt:
        print("dq-producer: interrupted", file=sys.stderr)
        return INTERRUPTED

