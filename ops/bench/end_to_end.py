"""End-to-end benchmark: producers -> Redis -> the worker daemon (fast engine) -> results, on random weights.

    python ops/bench/end_to_end.py --shape 2b --fp8 --requests 6000 --out results/e2e-2b-fp8

One worker process runs the real daemon (intake, planner processes, packer, engine, Lua publication) on a random
model at a real Qwen3.5 shape; requests are real System One JSON rendered by a decision template (the tiny
checkpoint's tokenizer and template: token counts are what matter, the weights are random anyway). Phases:

1. peak: a backlog of ``--requests`` standard requests (256-768 tokens, noul + 4-way choice + 5-level score) is
   enqueued at once; throughput = tokens of all results / (first enqueue -> last result).
2. latency: requests paced at each of ``--loads`` x the peak rate for ``--latency-seconds``, one phase after the
   other; enqueue-to-result p50/p99 from the results' own timings (stream entry id -> publication).
0. in-process (first, in the worker process, once warm): the same engine times the same backlog's prompts without
   Redis, for the end-to-end / in-process ratio; the reference engine times the first 256.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this message spam?"},
    "topic": {"type": "choice", "instructions": "What is it about?",
              "criteria": {"billing": None, "delivery": None, "account": None, "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["none", "low", "medium", "high", "critical"]},
}
WORDS = ("the customer was charged twice for the order and the parcel arrived damaged please send a refund today "
         "account billing delivery message urgent help support team reply week month phone free offer").split()


def model_for(shape: str):
    """A random model at ``shape`` that renders requests with the tiny checkpoint's tokenizer and template;
    ``tiny``: the tiny checkpoint itself, on the CPU (checks this harness without a GPU)."""
    import tempfile

    from worker.model import checkpoint, tiny

    if shape == "tiny":
        return checkpoint.load(tiny.write(tempfile.mkdtemp(), multimodal=False), device="cpu")
    from synthetic import random_model

    return random_model(shape, rendering=tiny.rendering())


def settings_for(args: argparse.Namespace, **extra):
    from worker.config import Settings

    gpu = args.shape != "tiny"
    return Settings(checkpoint="(random)", device="cuda" if gpu else "cpu", engine="fast" if gpu else "reference",
                    fp8=args.fp8, fp8_layers=args.fp8_layers, compile=args.compile, compile_cache=args.compile_cache,
                    cuda_graphs=not args.no_graphs, buckets=args.buckets, planner_processes=args.planner_processes,
                    max_inflight=args.max_inflight, deterministic=args.deterministic, read_count=128,
                    claim_idle_ms=600_000, epilogues=args.epilogues, **extra)


def serve_worker(args: argparse.Namespace, make_model: Callable[[], Any] | None = None,
                 after_warmup: Callable[[Any], None] | None = None, **extra: Any) -> int:
    """A benchmark's worker process (``--worker``): the real daemon around ``make_model()`` (default: the random
    model of ``--shape``), with the benchmarks' settings and ``extra``, its metrics and health on
    ``--metrics-port``; ``after_warmup(daemon)`` runs before it reports ready."""
    from worker.daemon import Daemon
    from worker.health import serve_http
    from worker.logs import setup_logging

    setup_logging("text", "INFO")
    if args.deterministic:  # cuBLAS's settings precede the first GPU matmul, the random model's making included
        from worker.fast import invariant

        invariant.prepare_process()
    daemon = Daemon(settings_for(args, redis_url=args.redis_url, metrics_port=args.metrics_port, **extra),
                    model=make_model() if make_model is not None else model_for(args.shape))
    serve_http(daemon, args.metrics_port)
    return daemon.run(after_warmup=(lambda: after_warmup(daemon)) if after_warmup else None)


def run_worker(args: argparse.Namespace) -> int:
    """The worker process: the real daemon around a random model. Before it reports ready it times its own
    engine on the benchmark's backlog in process (the end-to-end / in-process ratio needs both figures from one
    warmed-up engine), and the reference engine on the backlog's first requests."""
    return serve_worker(args, after_warmup=lambda daemon: self_time(daemon, args))


def self_time(daemon, args: argparse.Namespace) -> None:
    import torch
    from fast_path import timed
    from synthetic import packs, padded_batches, warmup_batches

    from producer.schema import Request
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


def make_requests(count: int, seed: int, encoder, tokens: tuple[int, int] = (256, 768),
                  questions: dict = QUESTIONS) -> list[dict]:
    """Requests whose rendered prompts have ``tokens`` tokens (uniform; standard: 256-768)."""
    from producer.schema import Request

    rng = random.Random(seed)
    probe = [Request.model_validate({"state": " ".join(WORDS[:n]) if n else "", "questions": questions})
             for n in (0, len(WORDS))]
    base, full = (encoder.prompts(r)[0].length for r in probe)
    per_word = (full - base) / len(WORDS)
    out = []
    for i in range(count):
        target = rng.randint(*tokens)
        words = max(1, round((target - base) / per_word))
        out.append({"id": f"b{seed}-{i}", "state": " ".join(rng.choice(WORDS) for _ in range(words)),
                    "questions": questions})
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


def gpu_time(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """The packs' own GPU time and the GPU's idle time between packs over a phase (engine-measured, CUDA events)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    busy, idle = delta("dq_pack_gpu_seconds_sum"), delta("dq_gpu_idle_seconds_sum")
    return {"gpu_busy_fraction": round(busy / seconds, 3), "gpu_idle_between_packs_s": round(idle, 2),
            "packs": int(delta("dq_pack_gpu_seconds_count"))}


def gc_collections(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The worker's garbage collections over a phase, by generation (a full one, generation 2, stops every thread
    of the process while it walks what start-up did not freeze)."""
    return {generation: int(after.get(f"python_gc_collections_total{{generation={generation}}}", 0)
                            - before.get(f"python_gc_collections_total{{generation={generation}}}", 0))
            for generation in ("0", "1", "2")}


def slowest_pack_ms(before: dict[str, float], after: dict[str, float]) -> str:
    """The histogram bucket of the slowest pack (GPU time) in a phase: a stall shows here."""
    edges = sorted((float(key.split("{le=")[1].rstrip("}")), after[key] - before.get(key, 0.0))
                   for key in after if key.startswith("dq_pack_gpu_seconds_bucket"))
    total = edges[-1][1] if edges else 0
    below = [le for le, count in edges if count >= total]
    return f"<= {below[0] * 1000:g}" if below and total else "-"


def redis_fsync_stalls(url: str) -> int:
    """Writes Redis delayed because the AOF's fsync of the second before had not finished (a slow disk)."""
    import redis

    return int(redis.Redis.from_url(url).info("persistence").get("aof_delayed_fsync", 0))


def wait_ready(worker: subprocess.Popen, port: int, timeout: float, log_path: Path) -> float:
    """Seconds until the benchmark's worker answers /readyz with 200; SystemExit, with its log's tail, if it exits
    or takes longer than ``timeout``."""
    started = time.monotonic()
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                return round(time.monotonic() - started, 1)
        except OSError:
            pass
        if worker.poll() is not None or time.monotonic() - started > timeout:
            print(log_path.read_text()[-4000:])
            raise SystemExit("the worker did not become ready")
        time.sleep(0.5)


@contextlib.contextmanager
def worker_process(script: str, args: argparse.Namespace, url: str, log_path: Path,
                   *extra: str) -> Iterator[tuple[int, float]]:
    """A benchmark's worker process (``script --worker`` with the shared worker flags, then ``extra``), its output
    in ``log_path``: yields its metrics port and its seconds to ready; stopped on leaving."""
    from worker.redis_server import free_port

    port = free_port()
    cmd = [sys.executable, script, "--worker", "--shape", args.shape, "--redis-url", url, "--metrics-port", str(port),
           "--compile", args.compile, "--buckets", args.buckets, "--planner-processes", str(args.planner_processes),
           "--max-inflight", str(args.max_inflight)]
    cmd += ["--fp8", "--fp8-layers", args.fp8_layers] if args.fp8 else []
    cmd += ["--compile-cache", args.compile_cache] if args.compile_cache else []
    cmd += ["--no-graphs"] if args.no_graphs else []
    cmd += ["--deterministic"] if args.deterministic else []
    cmd += ["--epilogues", args.epilogues] if args.epilogues else []
    with open(log_path, "w") as log:
        worker = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            ready = wait_ready(worker, port, args.start_timeout, log_path)
            print(f"worker ready in {ready} s", flush=True)
            yield port, ready
        finally:
            worker.terminate()
            worker.wait(120)


def run_bench(args: argparse.Namespace) -> int:
    import signal

    import torch

    # A stage timeout sends SIGTERM: unwind, so that the worker process is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    from producer.client import Client
    from worker.model import tiny
    from worker.model.encoder import Encoder
    from worker.redis_server import RedisServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(tiny.rendering())
    backlog = make_requests(args.requests, 1, encoder)
    report: dict = {"shape": args.shape, "dtype": "fp8" if args.fp8 else "bf16", "fp8_layers": args.fp8_layers,
                    "compile": args.compile,
                    "graphs": not args.no_graphs, "buckets": args.buckets, "deterministic": args.deterministic,
                    "planner_processes": args.planner_processes,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"}
    self_time_file = out_dir / "in_process.json"
    extra = ["--requests", str(args.requests), "--self-time-file", str(self_time_file)]
    extra += ["--no-reference"] if args.no_reference else []
    with RedisServer("--appendfsync", "everysec") as server, \
            worker_process(__file__, args, server.url, out_dir / "worker.log", *extra) as (port, ready_seconds):
        report["worker_start_seconds"] = ready_seconds
        client = Client(server.url, max_unfinished=0)
        # Warm the whole path (planner processes, graphs, publication) before timing.
        client.wait_many(client.submit_many(make_requests(256, 2, encoder)), timeout=300)
        before = scrape(port)
        fsync = redis_fsync_stalls(server.url)
        ids = client.submit_many(backlog)
        results = client.wait_many(ids, timeout=args.timeout)
        after = scrape(port)
        ok = [r for r in results.values() if r.ok]
        assert len(ok) == len(ids), f"{len(ids) - len(ok)} errors"
        first = min(r.timings.enqueued_ms for r in ok)
        last = max(r.timings.finished_ms for r in ok)
        tokens = sum(r.usage.tokens for r in ok)
        seconds = (last - first) / 1000
        fills = (after.get("dq_pack_fill_ratio_sum", 0) - before.get("dq_pack_fill_ratio_sum", 0)) / max(
            1, after.get("dq_pack_fill_ratio_count", 0) - before.get("dq_pack_fill_ratio_count", 0))
        report["peak"] = {"requests": len(ok), "tokens": tokens, "seconds": round(seconds, 2),
                          "tokens_per_s": round(tokens / seconds), "requests_per_s": round(len(ok) / seconds, 1),
                          "pack_fill": round(fills, 3),
                          "gpu_peak_bytes": after.get("dq_gpu_memory_bytes{kind=peak}"),
                          "gpu_reserved_bytes": after.get("dq_gpu_memory_bytes{kind=reserved}"),
                          **gpu_time(before, after, seconds), "redis_delayed_fsyncs":
                              redis_fsync_stalls(server.url) - fsync}
        print("peak", report["peak"], flush=True)

        report["sweep"] = []
        for index, load in enumerate(args.loads):  # the first phase is the first latency run after ready
            phase = paced(client, encoder, port, server.url, load * len(ok) / seconds, args, seed=3 + 10 * index)
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


def worker_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmark's worker process, shared with priority.py."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="2b", choices=("0.8b", "2b", "4b", "tiny"),
                        help="tiny: the tiny checkpoint on the CPU (checks this harness without a GPU)")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--fp8-layers", default="all", help="the worker's --fp8-layers (with --fp8)")
    parser.add_argument("--compile", default="layer", choices=("none", "sub", "layer"))
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="the worker's --deterministic")
    parser.add_argument("--epilogues", default="", help="the worker's --epilogues (worker/fast/epilogues.py)")
    parser.add_argument("--compile-cache", default="", help="the worker's compile_cache (empty: the defaults)")
    parser.add_argument("--buckets", default="2048,4096,8192,16384")
    parser.add_argument("--planner-processes", type=int, default=4)
    parser.add_argument("--max-inflight", type=int, default=1024)
    parser.add_argument("--start-timeout", type=float, default=400.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_flags(parser)
    parser.add_argument("--self-time-file", help=argparse.SUPPRESS)
    parser.add_argument("--no-reference", action="store_true", help="skip timing the reference engine")
    parser.add_argument("--requests", type=int, default=6000, help="backlog size of the peak phase")
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
