"""How many requests per second one Redis shard carries for this workload, without the model.

Replays the exact Redis traffic of a request through the real code, without torch: producers send with
``AsyncClient.send`` (the submit function, batches of 500) and wait with ``wait_many`` (pipelined XRANGE + blocking
XREAD); consumers are the worker's Redis faces, ``worker.loop.consumer.Consumer.read`` (XREADGROUP over prompts and
requests, each entry parsed into a Delivery) and ``worker.loop.publisher.Publisher.settle`` (the publish function, XACK,
XDEL) with a result shaped like a real one. Nothing is computed: the consumers answer at once.

    python ops/redis_bench.py                      # starts its own redis-server (AOF, appendfsync always)
    python ops/redis_bench.py --appendfsync everysec --requests 50000
    python ops/redis_bench.py --redis-url redis://host:6379/0 --namespace bench   # an existing Redis

Reports requests/s end to end, Redis commands per request (INFO commandstats), and Redis CPU time per request:
``1 / cpu_per_request`` is what one Redis core can carry when the load generator is not on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from producer.client import AsyncClient, Prepared, aconnect, prepare  # noqa: E402
from producer.plumbing import library_loader  # noqa: E402
from producer.wire.keys import NORMAL, Keys  # noqa: E402
from worker.entries import Identity  # noqa: E402
from worker.loop.consumer import Consumer  # noqa: E402
from worker.loop.publisher import Publisher  # noqa: E402
from worker.outcomes import Outcome, Share, ok_result  # noqa: E402


def request(number: int, state_bytes: int, questions: int) -> dict:
    names = [f"q{k}" for k in range(questions)]
    return {"id": f"bench-{number}", "state": ("x" * state_bytes),
            "questions": {n: {"type": "choice", "instructions": "Which tone?",
                              "criteria": {"calm": "polite", "angry": None, "neutral": None}} for n in names}}


def share(questions: int) -> Share:
    """A part's share of a result with ``questions`` 3-option questions: about the size a worker publishes."""
    names = [f"q{k}" for k in range(questions)]
    options = ["calm", "angry", "neutral"]
    probabilities = [0.7123456, 0.2123456, 0.0753088]
    return Share(answers={n: {"type": "choice", "choice": "calm", "confidence": 0.7123456,
                              "probabilities": dict(zip(options, probabilities))} for n in names},
                 logits={n: [1.234567, 0.123456, -1.234567] for n in names},
                 probabilities={n: probabilities for n in names}, options={n: options for n in names},
                 tokens=120 * questions, prompts=1, compute_ms=3.2, started_ms=int(time.time() * 1000))


async def consumer(index: int, url: str, keys: Keys, read_count: int, questions: int, stop: asyncio.Event,
                   cluster: bool) -> int:
    client = aconnect(url, cluster)
    reader = Consumer(client, keys, f"bench-{os.getpid()}-{index}")
    publisher = Publisher(client, keys, 3600, "bench")
    # One result built once, renamed per request: the load generator spends its CPU on Redis calls, not pydantic.
    template = ok_result(Identity("x"), [share(questions)], [f"q{k}" for k in range(questions)], 0, "bench")
    settled = 0
    while not stop.is_set():
        deliveries = await reader.read(NORMAL, read_count, 200)
        outcomes = [Outcome(delivery, delivery.identity, result=template.model_copy(update={"id": delivery.request_id}))
                    for delivery in deliveries]
        if outcomes:
            await publisher.settle(outcomes)
            settled += len(outcomes)
    await client.aclose()
    return settled


async def producer(url: str, namespace: str, prepared: list[Prepared], batch: int, cluster: bool,
                   latencies: list[float]) -> None:
    async with AsyncClient(url, namespace, max_unfinished=0, cluster=cluster) as client:
        for start in range(0, len(prepared), batch):
            prompt = prepared[start: start + batch]
            began = time.perf_counter()
            await client.submit_many(prompt)  # prepared already: sent as they are, 500 per submit call
            await client.wait_many([item.id for item in prompt], timeout=300)
            latencies.append(time.perf_counter() - began)


def command_stats(connection: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): value["calls"]
            for name, value in connection.info("commandstats").items()}


def redis_cpu(connection: redis.Redis) -> float:
    info = connection.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


async def generate(args: argparse.Namespace, process: int, prepared: list[list[Prepared]]
                   ) -> tuple[int, list[float]]:
    """One load-generating process: its producers and its consumers (which take anyone's entries)."""
    keys = Keys(args.namespace)
    stop = asyncio.Event()
    consumers = [asyncio.create_task(consumer(process * 1000 + i, args.redis_url, keys, args.read_count,
                                              args.questions, stop, args.cluster)) for i in range(args.consumers)]
    latencies: list[float] = []
    await asyncio.gather(*(producer(args.redis_url, args.namespace, mine, args.batch, args.cluster, latencies)
                           for mine in prepared))
    stop.set()
    return sum(await asyncio.gather(*consumers)), latencies


def _generate(args: argparse.Namespace, process: int, out: multiprocessing.Queue, ready: multiprocessing.Queue,
              start: multiprocessing.Event) -> None:
    # Requests validated and serialized before the clock starts: the producer's CPU, not Redis'.
    per_producer = args.requests // args.processes // args.producers
    prepared = [[prepare(request((process * 1000 + producer_index) * 10_000_000 + number, args.state_bytes,
                                 args.questions)) for number in range(per_producer)]
                for producer_index in range(args.producers)]
    ready.put(process)
    start.wait()
    out.put(asyncio.run(generate(args, process, prepared)))


def run(args: argparse.Namespace) -> dict:
    keys = Keys(args.namespace)
    admin = redis.Redis.from_url(args.redis_url)
    for key in (keys.requests, keys.parts):
        try:
            admin.xgroup_create(key, keys.group, id="$", mkstream=True)
        except redis.ResponseError:
            pass
    library_loader.ensure(admin)  # what a worker does at start: the publish function is there before the first result
    out: multiprocessing.Queue = multiprocessing.Queue()
    ready: multiprocessing.Queue = multiprocessing.Queue()
    start = multiprocessing.Event()
    processes = [multiprocessing.Process(target=_generate, args=(args, i, out, ready, start))
                 for i in range(args.processes)]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get()
    before_stats, before_cpu = command_stats(admin), redis_cpu(admin)
    before_memory = admin.info("memory")["used_memory"]
    began = time.perf_counter()
    start.set()
    reports = [out.get() for _ in processes]
    seconds = time.perf_counter() - began
    for process in processes:
        process.join()
    settled = sum(n for n, _ in reports)
    latencies = [t for _, ts in reports for t in ts]
    done = args.requests // args.processes // args.producers * args.producers * args.processes
    calls = {name: n - before_stats.get(name, 0) for name, n in command_stats(admin).items()}
    calls = {name: round(n / done, 3) for name, n in sorted(calls.items(), key=lambda kv: -kv[1])
             if n > 0 and not name.startswith(("info", "xgroup", "client", "config"))}
    cpu = redis_cpu(admin) - before_cpu
    # What stays behind per request: its result stream, until the result TTL (the work streams are empty again).
    retained = (admin.info("memory")["used_memory"] - before_memory) / done
    latencies.sort()
    return {"requests": done, "settled": settled, "seconds": round(seconds, 2),
            "requests_per_second": round(done / seconds),
            "redis_cpu_seconds": round(cpu, 2), "redis_cpu_share": round(cpu / seconds, 2),
            "redis_cpu_us_per_request": round(cpu / done * 1e6, 1),
            "one_core_ceiling_requests_per_second": round(done / cpu) if cpu else None,
            "batch_round_trip_p50_s": round(latencies[len(latencies) // 2], 3),
            "memory_bytes_per_result": round(retained),
            "commands_per_request": calls,
            "settings": {k: v for k, v in vars(args).items() if k != "redis_url"},
            "redis_version": admin.info("server")["redis_version"],
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
                       f"{platform.python_version()}, redis-py {redis.__version__}, "
                       f"hiredis {'yes' if _hiredis() else 'no'}"}


def _hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="an existing Redis (default: start a local redis-server)")
    parser.add_argument("--cluster", action="store_true", help="the URL is a Redis Cluster node")
    parser.add_argument("--namespace", default="bench")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=1, help="load-generating processes")
    parser.add_argument("--producers", type=int, default=4, help="concurrent producers per process (each waits per "
                                                                  "batch)")
    parser.add_argument("--batch", type=int, default=500, help="requests per submit call")
    parser.add_argument("--consumers", type=int, default=4, help="concurrent worker read/settle loops per process")
    parser.add_argument("--read-count", type=int, default=64, help="entries per XREADGROUP (DQ_READ_COUNT)")
    parser.add_argument("--state-bytes", type=int, default=1000, help="size of each request's state")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--appendfsync", default="always", choices=("always", "everysec", "no"),
                        help="AOF fsync policy of the local redis-server")
    parser.add_argument("--stream-node-max-bytes", type=int, default=4096,
                        help="of the local redis-server: a one-entry result stream takes at least this")
    args = parser.parse_args(argv)
    server = None
    if not args.redis_url:
        from producer.local.server import RedisServer

        server = RedisServer("--appendfsync", args.appendfsync,
                             "--stream-node-max-bytes", str(args.stream_node_max_bytes)).start()
        args.redis_url = server.url
    try:
        report = run(args)
    finally:
        if server is not None:
            server.__exit__()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
