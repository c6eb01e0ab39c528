"""End-to-end benchmark: producers -> Redis -> the worker daemon (fast engine) -> results, on random weights.

    python ops/bench/end_to_end.py --shape 2b --fp8 --requests 6000 --out results/e2e-2b-fp8

One worker process runs the real daemon (intake, planner processes, packer, engine, Lua publication) on a random
model at a real Qwen3.5 shape; requests are real System One JSON rendered by a decision template (the tiny
checkpoint's tokenizer and template: token counts are what matter, the weights are random anyway). Phases:

1. peak: a backlog of ``--requests`` standard requests (256-768 tokens, noul + 4-way choice + 5-level score) is
   enqueued at once; throughput = tokens of all results / (first enqueue -> last result). ``--peaks`` times (the
   same backlog under fresh ids), the median of them reported (b392b26's gate: fresh workers' peaks 174.5k to
   178.5k, a spread as wide as the margin of the end-to-end / in-process target).
2. latency: requests paced at each of ``--loads`` x the peak rate for ``--latency-seconds``, one phase after the
   other; enqueue-to-result p50/p99 from the results' own timings (stream entry id -> publication).
0. in-process (first, in the worker process, once warm): the same engine times the same backlog's prompts without
   Redis, for the end-to-end / in-process ratio; the reference engine times the first 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served import deterministic_of, serve_worker, worker_flags, worker_process  # noqa: E402
from traffic import (gc_collections, gpu_time, make_requests, percentile, redis_fsync_stalls, scrape,  # noqa: E402
                     slowest_pack_ms)


def run_worker(args: argparse.Namespace) -> int:
    """The worker process: the real daemon around a random model. Before it reports ready it times its own
    engine on the benchmark's backlog in process (the end-to-end / in-process ratio needs both figures from one
    warmed-up engine), and the reference engine on the backlog's first requests."""
    return serve_worker(args, after_warmup=lambda daemon: self_time(daemon, args))


def self_time(daemon, args: argparse.Namespace) -> None:
    import torch
    from fast_path import timed
    from synthetic import packs, padded_batches, warmup_batches

    from producer.wire.schema import Request
    from worker.model.encoder import Encoder
    from worker.model.reference import ReferenceEngine

    began = time.perf_counter()
    encoder = Encoder(daemon.model)
    prompts = [c for r in make_requests(args.requests, 1, encoder) for c in encoder.prompts(Request.model_validate(r))]
    groups = packs(prompts, daemon.engine.max_pack_tokens)
    timed(daemon.engine, groups[: max(1, len(groups) // 8)])
    seconds, _ = timed(daemon.engine, groups)
    tokens = sum(c.length for c in prompts)
    report = {"tokens_per_s": round(tokens / seconds), "requests_per_s": round(args.requests / seconds, 1),
              "seconds": round(seconds, 2), "packs": len(groups)}
    cuda = torch.cuda.is_available()
    if cuda:
        from fast_path import profile

        report["profile"] = profile(daemon.engine, groups[:8])  # kernel families, ms per 16k-token pack
        report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        report["reserved_bytes"] = torch.cuda.memory_reserved()
    if not args.no_reference:
        sample = prompts[:256]
        reference = ReferenceEngine(daemon.model)
        batches = padded_batches(sample)
        for batch in warmup_batches(batches):  # kernel compilation outside the timing
            reference.forward(batch)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches:
            reference.forward(batch)
        if cuda:
            torch.cuda.synchronize()
        ref_seconds = time.perf_counter() - start
        report["reference_tokens_per_s"] = round(sum(c.length for c in sample) / ref_seconds)
    report["self_time_seconds"] = round(time.perf_counter() - began, 1)  # the benchmark's own work before ready
    Path(args.self_time_file).write_text(json.dumps(report))


def run_bench(args: argparse.Namespace) -> int:
    import signal

    import torch

    # A stage timeout sends SIGTERM: unwind, so that the worker process is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    from producer.client import Client
    from worker.model import tiny
    from worker.model.encoder import Encoder
    from producer.local.server import RedisServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(tiny.rendering())
    backlog = make_requests(args.requests, 1, encoder)
    report: dict = {"shape": args.shape, "dtype": "fp8" if args.fp8 else "bf16", "fp8_layers": args.fp8_layers,
                    "compile": args.compile,
                    "graphs": not args.no_graphs, "buckets": args.buckets,
                    "planner_processes": args.planner_processes,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"}
    self_time_file = out_dir / "in_process.json"
    extra = ["--requests", str(args.requests), "--self-time-file", str(self_time_file)]
    extra += ["--no-reference"] if args.no_reference else []
    with RedisServer("--appendfsync", "everysec") as server, \
            worker_process(__file__, args, server.url, out_dir / "worker.log", *extra) as (port, ready_seconds):
        report["worker_start_seconds"] = ready_seconds
        report["deterministic"] = deterministic_of(port)  # as the worker decided (the flag may leave it unset)
        client = Client(server.url, max_unfinished=0)
        # Warm the whole path (planner processes, graphs, publication) before timing.
        client.wait_many(client.submit_many(make_requests(256, 2, encoder)), timeout=300)
        peaks = []
        for repeat in range(args.peaks):  # the same backlog again under fresh ids: the median of the runs
            backlog_now = backlog if repeat == 0 else [{**r, "id": f"{r['id']}-{repeat}"} for r in backlog]
            peaks.append(peak_phase(client, port, server.url, backlog_now, args.timeout))
        by_rate = sorted(peaks, key=lambda p: p["tokens_per_s"])
        report["peak"] = {**by_rate[len(by_rate) // 2], "runs_tokens_per_s": [p["tokens_per_s"] for p in peaks]}
        print("peak", report["peak"], flush=True)

        report["sweep"] = []
        for index, load in enumerate(args.loads):  # the first phase is the first latency run after ready
            rate = load * report["peak"]["requests_per_s"]
            phase = paced(client, encoder, port, server.url, rate, args, seed=3 + 10 * index)
            report["sweep"].append({"load": load, **phase})
            print("latency", report["sweep"][-1], flush=True)
        if report["sweep"]:
            report["latency"] = next((p for p in report["sweep"] if p["load"] == 0.5), report["sweep"][0])

    report["in_process"] = json.loads(self_time_file.read_text())
    report["worker_ready_without_self_time_seconds"] = round(
        report["worker_start_seconds"] - report["in_process"]["self_time_seconds"], 1)
    report["worker_log"] = [line.strip() for line in (out_dir / "worker.log").read_text().splitlines()
                            if "fast engine ready" in line or "objects frozen" in line]
    report["end_to_end_over_in_process"] = round(
        report["peak"]["tokens_per_s"] / report["in_process"]["tokens_per_s"], 3)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    ours = report["in_process"]
    print("SUMMARY", json.dumps({
        "dtype": report["dtype"], "deterministic": report["deterministic"],
        "end_to_end_tokens_per_s": report["peak"]["tokens_per_s"],
        "in_process_tokens_per_s": ours["tokens_per_s"], "ratio": report["end_to_end_over_in_process"],
        "reference_tokens_per_s": ours.get("reference_tokens_per_s"), "latency": report.get("latency"),
        "sweep": [{k: p[k] for k in ("load", "offered_requests_per_s", "p50_ms", "p99_ms", "max_ms",
                                     "gpu_busy_fraction")} for p in report["sweep"]],
        "peak_gpu_busy": report["peak"]["gpu_busy_fraction"], "start_s": report["worker_start_seconds"],
        "start_without_self_time_s": report["worker_ready_without_self_time_seconds"],
        "profile_ms_per_16k": {k: round(v, 2) for k, v in ours.get("profile", {}).get("per_16k_tokens_ms", {}).items()},
        "worker_log": report["worker_log"]}), flush=True)
    return 0


def peak_phase(client, port: int, url: str, backlog: list[dict], timeout: float) -> dict:
    """A backlog enqueued at once: tokens of all results over first enqueue to last result, the packs' fill and
    the GPU's busy time."""
    before, fsync = scrape(port), redis_fsync_stalls(url)
    ids = client.submit_many(backlog)
    results = client.wait_many(ids, timeout=timeout)
    after = scrape(port)
    ok = [r for r in results.values() if r.ok]
    assert len(ok) == len(ids), f"{len(ids) - len(ok)} errors"
    first = min(r.timings.enqueued_ms for r in ok)
    last = max(r.timings.finished_ms for r in ok)
    tokens = sum(r.usage.tokens for r in ok)
    seconds = (last - first) / 1000
    fills = (after.get("dq_pack_fill_ratio_sum", 0) - before.get("dq_pack_fill_ratio_sum", 0)) / max(
        1, after.get("dq_pack_fill_ratio_count", 0) - before.get("dq_pack_fill_ratio_count", 0))
    return {"requests": len(ok), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "requests_per_s": round(len(ok) / seconds, 1),
            "pack_fill": round(fills, 3), "gpu_peak_bytes": after.get("dq_gpu_memory_bytes{kind=peak}"),
            "gpu_reserved_bytes": after.get("dq_gpu_memory_bytes{kind=reserved}"),
            **gpu_time(before, after, seconds), "redis_delayed_fsyncs": redis_fsync_stalls(url) - fsync}


def paced(client, encoder, port: int, url: str, rate: float, args: argparse.Namespace, seed: int) -> dict:
    """Requests paced at ``rate`` per second for ``--latency-seconds``: enqueue-to-result p50/p99/max from the
    results' own timings, and the GPU's busy fraction over the phase."""
    requests = make_requests(max(1, int(rate * args.latency_seconds)), seed, encoder)
    before, fsync = scrape(port), redis_fsync_stalls(url)
    ids = []
    t0 = time.monotonic()
    for i, request in enumerate(requests):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        ids.append(client.submit(request))
    results = client.wait_many(ids, timeout=args.timeout)
    phase_seconds = time.monotonic() - t0
    final = scrape(port)
    latency = [r.timings.finished_ms - r.timings.enqueued_ms for r in results.values() if r.ok]
    return {"offered_requests_per_s": round(rate, 1), "requests": len(latency),
            "p50_ms": percentile(latency, 0.5), "p99_ms": percentile(latency, 0.99), "max_ms": max(latency),
            "slowest_pack_ms": slowest_pack_ms(before, final), "gc_collections": gc_collections(before, final),
            **gpu_time(before, final, phase_seconds),
            "redis_delayed_fsyncs": redis_fsync_stalls(url) - fsync}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_flags(parser)
    parser.add_argument("--self-time-file", help=argparse.SUPPRESS)
    parser.add_argument("--no-reference", action="store_true", help="skip timing the reference engine")
    parser.add_argument("--requests", type=int, default=6000, help="backlog size of the peak phase")
    parser.add_argument("--peaks", type=int, default=3, help="peak phases, each the backlog again; the report's "
                        "peak is their median (one fresh worker's phases differ by a few percent)")
    parser.add_argument("--loads", type=lambda text: [float(x) for x in text.split(",") if x], default=[0.5],
                        help="offered loads of the latency phases, x peak, in order (e.g. 0.1,0.2,...,1.0; the "
                             "phase at 0.5, else the first, is the report's latency); empty: none")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default="e2e-results")
    args = parser.parse_args()
    return run_worker(args) if args.worker else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
