"""``python -m producer``: submit a JSONL file of requests (and wait for the results), or show queue stats.

    python -m producer submit --redis URL requests.jsonl --wait --out results.jsonl
    python -m producer stats --redis URL
    python -m producer result --redis URL ID [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from .client import Client, InvalidRequest, QueueFull, ResultTimeout, prepare
from .schema import ErrorCode, Result


class Progress:
    """One status line on stderr: redrawn on a terminal, printed every 10 s otherwise."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.start = time.monotonic()

    def show(self, submitted: int, answered: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        rate = answered / max(now - self.start, 1e-9)
        line = f"submitted {submitted}/{self.total}  answered {answered}/{self.total}  {rate:.1f}/s"
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if force and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _read(path: str) -> list[tuple[str, Any]]:
    """(id, prepared body or local error Result) per non-empty line."""
    out: list[tuple[str, Any]] = []
    handle = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            fallback = f"line-{number}"
            try:
                data = json.loads(line)
            except ValueError as error:
                out.append((fallback, Result.failure(fallback, ErrorCode.INVALID_JSON, f"line {number}: {error}")))
                continue
            rid = data.get("id") if isinstance(data, dict) and isinstance(data.get("id"), str) else fallback
            try:
                out.append(prepare(data))
            except InvalidRequest as error:
                out.append((rid, Result.failure(rid, ErrorCode.INVALID_REQUEST, str(error))))
    return out


def _write(out: TextIO | None, result: Result) -> None:
    if out is not None:
        out.write(result.model_dump_json(exclude_none=True) + "\n")


def submit(args: argparse.Namespace) -> int:
    client = Client(args.redis, args.namespace, max_unfinished=args.max_unfinished, cluster=args.cluster)
    items = _read(args.file)
    progress = Progress(len(items), args.quiet)
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    failed = 0
    pending: list[str] = []
    submitted = 0
    for rid, item in items:
        if isinstance(item, Result):  # refused locally: the same error a worker would give
            _write(out, item)
            failed += 1
    bodies = [(rid, body) for rid, body in items if not isinstance(body, Result)]
    for start in range(0, len(bodies), args.batch):
        batch = bodies[start: start + args.batch]
        delay = 0.05
        while True:
            try:
                client.send([body for _, body in batch])
                break
            except QueueFull:
                progress.show(submitted, 0)
                time.sleep(delay)  # backpressure: wait for workers to drain the stream
                delay = min(delay * 2, 2.0)
        submitted += len(batch)
        pending += [rid for rid, _ in batch]
        progress.show(submitted, 0)
    if not args.wait:
        progress.show(submitted, 0, force=True)
        for rid in pending:
            print(rid)
        return 0
    answered = 0
    deadline = time.monotonic() + args.timeout
    while pending:
        window = pending[:1000]
        try:
            done = client.wait_many(window, timeout=min(2.0, max(0.0, deadline - time.monotonic())))
        except ResultTimeout:
            done = {rid: r for rid in window if (r := client.fetch(rid)) is not None}
        for rid, result in done.items():
            _write(out, result)
            failed += not result.ok
        answered += len(done)
        pending = [rid for rid in pending if rid not in done]
        progress.show(submitted, answered + failed)
        if pending and time.monotonic() > deadline:
            print(f"timed out: {len(pending)} results missing (they stay fetchable until their TTL)", file=sys.stderr)
            return 1
    progress.show(submitted, answered, force=True)
    if out:
        out.close()
    return 0


def stats(args: argparse.Namespace) -> int:
    print(json.dumps(Client(args.redis, args.namespace, cluster=args.cluster).stats(), indent=2, default=str))
    return 0


def result(args: argparse.Namespace) -> int:
    client = Client(args.redis, args.namespace, cluster=args.cluster)
    try:
        found = client.wait(args.id, args.wait) if args.wait else client.fetch(args.id)
    except ResultTimeout:
        found = None
    if found is None:
        print(f"no result for {args.id}", file=sys.stderr)
        return 1
    print(found.model_dump_json(exclude_none=True, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL (rediss:// for TLS)")
    common.add_argument("--namespace", default="dq")
    common.add_argument("--cluster", action="store_true", help="the URL is a node of a Redis Cluster")

    sub = commands.add_parser("submit", parents=[common], help="submit a JSONL file, one request per line")
    sub.add_argument("file", help="JSONL file, or - for stdin")
    sub.add_argument("--wait", action="store_true", help="wait for every result")
    sub.add_argument("--out", help="write one result JSON per line here")
    sub.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all results")
    sub.add_argument("--batch", type=int, default=500)
    sub.add_argument("--max-unfinished", type=int, default=100_000, help="backpressure limit (0: none)")
    sub.add_argument("--quiet", action="store_true", help="no progress line")
    sub.set_defaults(run=submit)

    st = commands.add_parser("stats", parents=[common], help="stream length, pending, lag, consumers, dead letters")
    st.set_defaults(run=stats)

    res = commands.add_parser("result", parents=[common], help="print one result")
    res.add_argument("id")
    res.add_argument("--wait", type=float, default=0.0, help="seconds to wait for it")
    res.set_defaults(run=result)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except QueueFull as error:
        print(f"queue full: {error}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
