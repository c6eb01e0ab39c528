"""Horizontal scaling on one host: the standard workload end to end through one Redis with 1, 2, 4 (8) GPUs, the
workers started by the launcher (``dq-worker serve --gpus``, worker/launch/launcher.py), then over Redis shards.

    python ops/bench/scaling.py --gpus 1,2,4 --shape 2b --out results/scaling            # one Redis, 1/2/4 GPUs
    python ops/bench/scaling.py --gpus 4 --shape 2b --shards 2 --out results/scaling      # a 2-node Redis Cluster
    python ops/bench/scaling.py --gpus 1,2 --shape tiny --warmup-per-gpu 8 --requests-per-gpu 32 --out /tmp/s
                                                  # CPU smoke: cpu:N workers on the tiny checkpoint (no figures)

For each GPU count N (one command per count where a command's time is bounded; the same --out gathers them):

- Redis: one server (AOF, fsync every second, as end_to_end.py), or with ``--shards K`` a Redis Cluster of K
  primaries carrying K stream shards; one launcher per shard, GPU i serving shard i mod K. GPU workers run the real
  daemon around a random model at ``--shape`` (served.py's); ``tiny`` runs ``python -m worker serve`` on the
  tiny checkpoint, on the CPU.
- warm-up (``--warmup-per-gpu``, 256), then peak: a backlog of ``--requests-per-gpu`` x N standard requests (256-768
  tokens), tokens/s from the first enqueue to the last result; then latency: requests paced at ``--load`` x that
  peak for ``--latency-seconds``, p50/p99 enqueue to result.
- per phase: each worker's GPU busy fraction (its packs' own GPU time), each Redis node's CPU (cores, from INFO) and
  commands/s, the host's CPU busy fraction (/proc/stat), and the producer's side: one Python process submits the
  backlog, its submit rate and CPU; a backlog submitted slower than the workers answer is the producer's limit.
- the launchers get SIGTERM at the end: their exit codes (0: every worker drained) are in the report.

Writes OUT/n{N}-s{K}-{dtype}.json per run and OUT/scaling.md, the table of every run found in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served import DEFAULTS, model_for, wait_ready  # noqa: E402
from traffic import gpu_time, make_requests, percentile, scrape  # noqa: E402

# ---------------------------------------------------------------- the launcher's and the workers' processes

def run_launcher(args: argparse.Namespace) -> int:
    """One shard's launcher: the settings come as DQ_* variables; GPU workers are this file's --worker."""
    from worker.launch import launcher
    from worker.config import Settings

    command = None if args.shape == "tiny" else [sys.executable, __file__, "--worker", "--shape", args.shape]
    return launcher.serve(Settings.from_env(), command)


def run_worker(args: argparse.Namespace) -> int:
    """A GPU worker: the real daemon around a random model, with the settings its launcher gave it (its device is
    the one GPU it sees)."""
    from worker.config import Settings
    from worker.daemon import Daemon
    from worker.health import serve_http
    from worker.logs import setup_logging

    settings = Settings.from_env()
    setup_logging(settings.log_format, settings.log_level)
    daemon = Daemon(settings, model=model_for(args.shape))
    serve_http(daemon, settings.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, daemon.on_signal)
    return daemon.run()


# ---------------------------------------------------------------- measurements

def host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of every core since boot."""
    values = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def redis_counters(urls: list[str]) -> list[dict[str, float]]:
    import redis

    out = []
    for url in urls:
        client = redis.Redis.from_url(url)
        info = client.info("cpu") | client.info("stats")
        out.append({"cpu_s": info["used_cpu_sys"] + info["used_cpu_user"],
                    "commands": info["total_commands_processed"]})
        client.close()
    return out


class Probe:
    """Before and after a phase: every worker's metrics, every Redis node, the host's CPU, this process' CPU."""

    def __init__(self, ports: list[int], urls: list[str]) -> None:
        self.ports, self.urls = ports, urls

    def take(self) -> dict:
        return {"workers": [scrape(port) for port in self.ports], "redis": redis_counters(self.urls),
                "host": host_cpu(), "self_cpu": time.process_time(), "at": time.monotonic()}

    @staticmethod
    def phase(before: dict, after: dict, seconds: float) -> dict:
        wall = after["at"] - before["at"]
        busy = (after["host"][0] - before["host"][0]) / max(1.0, after["host"][1] - before["host"][1])
        return {"gpu_busy_per_worker": [gpu_time(b, a, seconds)["gpu_busy_fraction"]
                                        for b, a in zip(before["workers"], after["workers"])],
                "redis_cores_per_node": [round((a["cpu_s"] - b["cpu_s"]) / wall, 3)
                                         for b, a in zip(before["redis"], after["redis"])],
                "redis_commands_per_s_per_node": [round((a["commands"] - b["commands"]) / wall)
                                                  for b, a in zip(before["redis"], after["redis"])],
                "host_cpu_busy": round(busy, 3),
                "producer_cores": round((after["self_cpu"] - before["self_cpu"]) / wall, 3)}


def paced(client, requests: list[dict], rate: float) -> tuple[list[str], float]:
    """Submit at ``rate`` requests/s in 10 ms ticks (each tick's due requests in one call); ids and seconds."""
    ids: list[str] = []
    start, sent = time.monotonic(), 0
    while sent < len(requests):
        due = min(len(requests), int((time.monotonic() - start) * rate) + 1)
        if due > sent:
            ids += client.submit_many(requests[sent:due])
            sent = due
        time.sleep(0.01)
    return ids, time.monotonic() - start


# ---------------------------------------------------------------- one run: N GPUs over K shards

def start_launchers(args: argparse.Namespace, gpus: int, url: str, cluster: bool, out: Path, tiny: str
                    ) -> list[tuple[subprocess.Popen, int, int]]:
    """(process, base port, workers) per shard."""
    from producer.local.ports import free_ports

    started = []
    cpu = args.shape == "tiny"
    for shard in range(args.shards):
        mine = [str(i) for i in range(gpus) if i % args.shards == shard]
        base = free_ports(len(mine) + 1)
        env = dict(os.environ, PYTHONUNBUFFERED="1", DQ_GPUS=f"cpu:{len(mine)}" if cpu else ",".join(mine),
                   DQ_CHECKPOINT=tiny if cpu else "(random)", DQ_ENGINE="reference" if cpu else "fast",
                   DQ_REDIS_URL=url, DQ_REDIS_CLUSTER=str(cluster).lower(), DQ_SHARD=str(shard),
                   DQ_METRICS_PORT=str(base), DQ_FP8=str(args.fp8).lower(), DQ_COMPILE_CACHE=args.compile_cache,
                   DQ_BUCKETS=args.buckets, DQ_PLANNER_PROCESSES=str(planners(args, gpus)),
                   DQ_MAX_INFLIGHT=str(args.max_inflight), DQ_READ_COUNT="128", DQ_CLAIM_IDLE_MS="600000")
        log = open(out / f"launcher-n{gpus}-s{shard}.log", "w")
        process = subprocess.Popen([sys.executable, __file__, "--launch", "--shape", args.shape], env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        started.append((process, base, len(mine)))
    return started


def planners(args: argparse.Namespace, gpus: int) -> int:
    """Planner processes per worker: as the launcher sizes them, but over all the host's GPUs (each shard's
    launcher alone would count only its own workers against the whole host's cores)."""
    from worker.launch.host import host_cores, planner_processes

    return planner_processes(args.planner_processes, gpus, host_cores(), args.shape != "tiny")


def run_once(args: argparse.Namespace, gpus: int, out: Path) -> dict:
    from producer.client import Client
    from worker.model import tiny as tiny_model
    from worker.model.encoder import Encoder
    from producer.local.server import LocalCluster, RedisServer

    encoder = Encoder(tiny_model.rendering())
    tiny = str(tiny_model.write(out / "tiny-checkpoint", multimodal=False)) if args.shape == "tiny" else ""
    cluster = args.shards > 1
    redis = (LocalCluster(args.shards, "--appendfsync", "everysec") if cluster
             else RedisServer("--appendfsync", "everysec")).start()
    nodes = redis.nodes if cluster else [redis]
    report: dict = {"gpus": gpus, "shards": args.shards, "shape": args.shape, "dtype": "fp8" if args.fp8 else "bf16",
                    "redis": f"{nodes[0].server.family} {'.'.join(map(str, nodes[0].version))}",
                    "host_cores": os.cpu_count(), "machine": machine(), "planner_processes": planners(args, gpus)}
    launchers = []
    try:
        launchers = start_launchers(args, gpus, redis.url, cluster, out, tiny)
        began = time.monotonic()  # each launcher ready (its /readyz: every worker of it ready)
        for shard, (process, base, _) in enumerate(launchers):
            wait_ready(process, base, args.start_timeout - (time.monotonic() - began),
                       out / f"launcher-n{gpus}-s{shard}.log")
        report["start_seconds"] = round(time.monotonic() - began, 1)
        print(f"{gpus} workers ready in {report['start_seconds']} s", flush=True)
        ports = [base + 1 + i for _, base, count in launchers for i in range(count)]
        probe = Probe(ports, [node.url for node in nodes])
        client = Client(redis.url, max_unfinished=0, cluster=cluster, shards=args.shards)
        client.wait_many(client.submit_many(make_requests(args.warmup_per_gpu * gpus, 2, encoder)),
                         timeout=args.timeout)

        backlog = make_requests(args.requests_per_gpu * gpus, 1, encoder)
        before = probe.take()
        submit_began = time.monotonic()
        ids = client.submit_many(backlog)
        submit_seconds = time.monotonic() - submit_began
        results = client.wait_many(ids, timeout=args.timeout)
        after = probe.take()
        ok = [r for r in results.values() if r.ok]
        assert len(ok) == len(ids), f"{len(ids) - len(ok)} of {len(ids)} not answered ok"
        window = (max(r.timings.finished_ms for r in ok) - min(r.timings.enqueued_ms for r in ok)) / 1000
        tokens = sum(r.usage.tokens for r in ok)
        report["peak"] = {"requests": len(ok), "tokens": tokens, "seconds": round(window, 2),
                          "tokens_per_s": round(tokens / window), "requests_per_s": round(len(ok) / window, 1),
                          "submit_seconds": round(submit_seconds, 2),
                          "producer_submit_per_s": round(len(ids) / submit_seconds),
                          **Probe.phase(before, after, window)}
        print("peak", json.dumps(report["peak"]), flush=True)

        rate = args.load * len(ok) / window
        requests = make_requests(max(1, int(rate * args.latency_seconds)), 3, encoder)
        before = probe.take()
        paced_ids, seconds = paced(client, requests, rate)
        answered = client.wait_many(paced_ids, timeout=args.timeout)
        after = probe.take()
        latency = [r.timings.finished_ms - r.timings.enqueued_ms for r in answered.values() if r.ok]
        report["latency"] = {"offered_requests_per_s": round(rate, 1), "achieved_submit_per_s":
                             round(len(paced_ids) / seconds, 1), "requests": len(latency),
                             "p50_ms": percentile(latency, 0.5), "p99_ms": percentile(latency, 0.99),
                             "max_ms": max(latency), **Probe.phase(before, after, after["at"] - before["at"])}
        print("latency", json.dumps(report["latency"]), flush=True)
    finally:
        report["launcher_exit_codes"] = stop(launchers)
        redis.stop() if cluster else redis.__exit__()
    return report


def stop(launchers: list[tuple[subprocess.Popen, int, int]]) -> list[int | None]:
    for process, _, _ in launchers:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for process, _, _ in launchers:
        try:
            codes.append(process.wait(120))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(None)
    return codes


def machine() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout.split("\n")
        gpus = [n for n in names if n.strip()]
        return f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    except OSError:
        return "no GPU (no nvidia-smi)"


# ---------------------------------------------------------------- the table

def table(out: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("n*-s*.json"))]
    runs.sort(key=lambda r: (r["shape"], r["dtype"], r["shards"], r["gpus"]))
    one = {(r["shape"], r["dtype"]): r["peak"]["tokens_per_s"] for r in runs if r["gpus"] == 1 and r["shards"] == 1}
    lines = ["| shape | dtype | GPUs | Redis shards | tokens/s | x 1 GPU (per GPU) | p50 / p99 ms at half peak | "
             "GPU busy per worker | Redis cores per node | Redis commands/s | host CPU busy | "
             "producer submit/s (cores) | launcher exits |", "|" + "---|" * 13]
    for r in runs:
        peak, lat = r["peak"], r["latency"]
        base = one.get((r["shape"], r["dtype"]))  # one GPU through one Redis
        ratio = f"{peak['tokens_per_s'] / base:.2f}x ({peak['tokens_per_s'] / base / r['gpus']:.2f})" if base else "-"
        cells = [r["shape"], r["dtype"], r["gpus"], r["shards"], f"{peak['tokens_per_s']:,}", ratio,
                 f"{lat['p50_ms']:.0f} / {lat['p99_ms']:.0f}",
                 ", ".join(f"{b:.2f}" for b in peak["gpu_busy_per_worker"]),
                 ", ".join(f"{c:.2f}" for c in peak["redis_cores_per_node"]),
                 f"{sum(peak['redis_commands_per_s_per_node']):,}", f"{peak['host_cpu_busy']:.2f}",
                 f"{peak['producer_submit_per_s']:,} ({peak['producer_cores']:.2f})", r["launcher_exit_codes"]]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    machines = sorted({f"{r['machine']}, {r['host_cores']} cores, {r['redis']}" for r in runs})
    return "\n".join(lines) + "\n\nMachine: " + "; ".join(machines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to run, one after another [default 1,2,4]")
    parser.add_argument("--shards", type=int, default=1,
                        help="stream shards; over 1: a Redis Cluster of that many primaries [default 1]")
    parser.add_argument("--shape", default="2b", choices=("0.8b", "2b", "4b", "tiny"),
                        help="tiny: cpu:N workers on the tiny checkpoint (checks this harness without a GPU)")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--compile-cache", default="", help="the workers' DQ_COMPILE_CACHE (shared by all)")
    parser.add_argument("--buckets", default=DEFAULTS.buckets, help="the workers' --buckets")
    parser.add_argument("--planner-processes", type=int, default=0,
                        help="per worker; 0: the launcher shares the host's cores out [default 0]")
    parser.add_argument("--max-inflight", type=int, default=1024)
    parser.add_argument("--warmup-per-gpu", type=int, default=256, help="warm-up requests per GPU [default 256]")
    parser.add_argument("--requests-per-gpu", type=int, default=3000, help="peak backlog per GPU [default 3000]")
    parser.add_argument("--load", type=float, default=0.5, help="offered load of the latency phase, x peak")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--start-timeout", type=float, default=420.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default="scaling-results")
    args = parser.parse_args()
    if args.launch:
        return run_launcher(args)
    if args.worker:
        return run_worker(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stage timeout: unwind, stopping launchers and Redis
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for gpus in (int(n) for n in args.gpus.split(",")):
        if gpus < args.shards:
            print(f"skipped {gpus} GPUs: fewer than the {args.shards} shards", flush=True)
            continue
        report = run_once(args, gpus, out)
        name = f"n{gpus}-s{args.shards}-{report['dtype']}{'-' + args.shape if args.shape != '2b' else ''}.json"
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
        (out / "scaling.md").write_text(table(out))
        print("SUMMARY", json.dumps({k: report[k] for k in ("gpus", "shards", "start_seconds", "launcher_exit_codes")}
                                    | {"tokens_per_s": report["peak"]["tokens_per_s"],
                                       "p99_ms": report["latency"]["p99_ms"]}), flush=True)
    print((out / "scaling.md").read_text() if (out / "scaling.md").exists() else "no run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
