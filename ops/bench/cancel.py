"""Cancels under load, on the CPU: a backlog of queued requests cancelled while one worker drains it, and the
queue's throughput with no cancel at all (docs/BENCHMARKS.md, "Cancel").

    python ops/bench/cancel.py --requests 20000 --out /tmp/cancel          # both phases
    python ops/bench/cancel.py --requests 0 --baseline 3000 --out /tmp/b   # the throughput phase alone

One worker process (served.py: the real daemon on the tiny checkpoint, reference engine, CPU) and a redis-server of
its own; the producer is the Python client. Phases:

1. baseline: ``--baseline`` requests enqueued at once and drained, no cancel anywhere: requests/s and tokens/s from
   the first enqueue to the last result. It uses nothing that a tree without cancel lacks, so the same command on
   the commit before cancel measures "before" (docs/BENCHMARKS.md says how).
2. cancel: ``--requests`` enqueued at once; ``--after`` seconds into the drain, one ``Client.cancel`` of all of
   them, timed. What the call found (answered, held by the worker, queued), then every result: those answered ok
   were computed anyway; each must be one the call found answered or held (planned, queued or packed), never one
   it found queued. The worker's prompt count says how many prompts it computed in the phase.

Writes ``report.json`` in ``--out`` and prints one ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served import serve_worker, worker_flags, worker_process  # noqa: E402
from traffic import make_requests, scrape  # noqa: E402


def drained(client, requests: list[dict], timeout: float) -> dict:
    """Enqueue ``requests`` at once and wait for every result: requests/s and tokens/s over the whole drain."""
    started = time.time()
    results = client.wait_many(client.submit_many(requests), timeout=timeout)
    seconds = max(r.timings.finished_ms for r in results.values()) / 1000 - started
    tokens = sum(r.usage.tokens for r in results.values() if r.usage)
    return {"requests": len(results), "seconds": round(seconds, 2), "requests_per_s": round(len(results) / seconds, 1),
            "tokens_per_s": round(tokens / seconds)}


def cancelled_drain(client, requests: list[dict], after: float, port: int, timeout: float) -> dict:
    """Enqueue, cancel them all ``after`` seconds into the drain, wait for every result."""
    before = scrape(port)
    ids = client.submit_many(requests)
    time.sleep(after)
    started = time.perf_counter()
    found = client.cancel(ids)
    call_s = time.perf_counter() - started
    results = client.wait_many(ids, timeout=timeout)
    drained_s = time.perf_counter() - started
    seen = scrape(port)
    at_call = Counter(answer.state for answer in found.values())
    computed = Counter(found[r].state for r, result in results.items() if result.ok)
    codes = Counter(str(getattr(result.error.code, "value", result.error.code)) if result.error else "ok"
                    for result in results.values())
    return {"requests": len(ids), "cancel_call_s": round(call_s, 3), "cancel_per_1000_ms": round(
            call_s * 1e6 / len(ids), 1), "found_at_call": dict(at_call), "answered_ok_by_found": dict(computed),
            "results": {str(code): n for code, n in codes.items()}, "after_call_drained_s": round(drained_s, 2),
            "prompts_computed": int(seen.get("dq_prompts_total", 0) - before.get("dq_prompts_total", 0)),
            "worker_cancels": {o: int(seen.get(f"dq_cancels_total{{outcome={o}}}", 0)
                                      - before.get(f"dq_cancels_total{{outcome={o}}}", 0))
                               for o in ("honoured", "too_late")},
            "computed_though_queued_at_call": computed.get("cancelled", 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_flags(parser)
    parser.set_defaults(shape="tiny", planner_processes=0, compile="none", max_inflight=512)
    parser.add_argument("--requests", type=int, default=20000, help="the cancel phase's backlog (0: none)")
    parser.add_argument("--baseline", type=int, default=2000, help="the throughput phase's requests (0: none)")
    parser.add_argument("--after", type=float, default=2.0, help="seconds into the drain the cancel comes")
    parser.add_argument("--tokens", default="32,96", help="prompt tokens per request, MIN,MAX (uniform): short "
                        "prompts make the queue's own costs show on the CPU")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("results/cancel"))
    args = parser.parse_args(argv)
    if args.worker:
        return serve_worker(args)

    from producer.client import Client
    from producer.local.server import RedisServer
    from worker.model import tiny
    from worker.model.encoder import Encoder

    args.out.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(tiny.rendering())
    low, high = (int(n) for n in args.tokens.split(","))
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    with RedisServer() as server, worker_process(__file__, args, server.url, args.out / "worker.log") as (port, _):
        client = Client(server.url, max_unfinished=0)
        client.wait_many(client.submit_many(make_requests(64, 9, encoder, (low, high))), timeout=args.timeout)  # warm
        if args.baseline:
            report["baseline"] = drained(client, make_requests(args.baseline, 1, encoder, (low, high)), args.timeout)
            print("baseline", report["baseline"], flush=True)
        if args.requests:
            report["cancel"] = cancelled_drain(client, make_requests(args.requests, 2, encoder, (low, high)), args.after, port,
                                               args.timeout)
            print("cancel", report["cancel"], flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    base, cancel = report.get("baseline", {}), report.get("cancel", {})
    print(f"SUMMARY baseline {base.get('requests_per_s')} req/s {base.get('tokens_per_s')} tok/s; cancel of "
          f"{cancel.get('requests')} in {cancel.get('cancel_call_s')} s, found {cancel.get('found_at_call')}, "
          f"ok (computed anyway) by what the call found {cancel.get('answered_ok_by_found')}, "
          f"prompts computed {cancel.get('prompts_computed')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
