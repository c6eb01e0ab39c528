"""The gateway's cost, on the CPU machine against a real Redis (producer/local/binaries.py's choice of server):

    python ops/bench/gateway.py --out OUT            # about a minute; OUT/gateway.json

1. latency: the same offered load (``--rate`` decisions per second, open loop, arrivals at even spacing) through
   the Python client (``AsyncClient.decide``) and through the gateway (``POST /v1/decide``, then, as a second run,
   ``POST /v1/systemone``: the System One route, routed by model), interleaved request by request so that both
   meet the same worker and Redis. A stand-in worker answers at once (``--worker echo``, the default: the model's
   own time on a shared CPU spreads by more than what is measured), or a real CPU worker on the tiny checkpoint
   (``--worker tiny``). Reported: each path's p50/p90/p99, and what the gateway adds at p50 (target: 2 ms at most).
2. throughput: ``POST /v1/requests`` (one request per call), ``--connections`` keep-alive connections in a closed
   loop for ``--seconds``, against one gateway process pinned to one core (the load generator and Redis on the
   other cores where there are any); no worker runs. Then ``POST /v1/systemone`` the same way, each call waiting
   for its answer from the stand-in worker (which runs beside the load). Reported: calls answered per second of
   wall time and per second of the gateway's own CPU time (target: 2,000 per second on one core).

The HTTP client is a few lines over asyncio streams (keep-alive, Content-Length), so that the client's own cost
stays out of the gateway's figure as far as it can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.client import AsyncClient  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"},
             "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}
# What the stand-in worker answers (a worker's answers to QUESTIONS), and the model name it serves under.
ANSWERS = {"refund": {"type": "noul", "noul": 0.75},
           "tone": {"type": "choice", "choice": "calm", "confidence": 0.5, "probabilities": {"calm": 0.75,
                                                                                             "angry": 0.25}}}
MODEL = "bench-model"
ROUTES = {"/v1/decide": lambda n: {"id": f"bench-{n}", "state": f"Message {n}: I was charged twice, refund me.",
                                   "questions": QUESTIONS},
          "/v1/systemone": lambda n: {"model": MODEL, "state": f"Message {n}: I was charged twice, refund me.",
                                      "questions": QUESTIONS}}


class Http:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> Http:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            return await self._post(path, body)
        except (asyncio.IncompleteReadError, ConnectionError):  # uvicorn closes connections idle for 5 s
            await self.open()
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return int(head[9:12]), await self.reader.readexactly(length)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(ms: list[float]) -> dict[str, float]:
    return {"count": len(ms), **{f"p{int(q * 100)}": round(percentile(ms, q), 3) for q in (0.5, 0.9, 0.99)}}


def start(args: list[str], log: Path, cpus: set[int] | None = None, **env: str) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def wait_http(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def answered(path: str, status: int, reply: bytes) -> bool:
    return status == 200 and ("answers" in json.loads(reply) if path == "/v1/systemone" else
                              json.loads(reply)["status"] == "ok")


async def latency(server: RedisServer, port: int, count: int, rate: float, stand_in: bool, path: str) -> dict:
    stop = asyncio.Event()
    responder = asyncio.create_task(echo(server.url, stop)) if stand_in else None
    client = AsyncClient(server.url)
    free = [await Http(port).open() for _ in range(8)]
    times: dict[str, list[float]] = {"client": [], "gateway": []}
    run = path.rsplit("/", 1)[1]

    async def one(n: int) -> None:
        body = {**ROUTES[path](f"lat-{run}-{n}"), "id": f"bench-lat-{run}-{n}"}
        started = time.perf_counter()
        if n % 2:
            connection = free.pop() if free else await Http(port).open()
            status, reply = await connection.post(path, json.dumps(ROUTES[path](f"lat-{run}-{n}")).encode())
            free.append(connection)
            assert answered(path, status, reply), reply[:300]
            times["gateway"].append((time.perf_counter() - started) * 1000)
        else:
            body.pop("model", None)
            assert (await client.decide(body, timeout=30)).ok
            times["client"].append((time.perf_counter() - started) * 1000)

    for n in range(20):  # warm both paths (connections, the server check, the worker's first packs)
        await one(-n - 1)
    times = {"client": [], "gateway": []}
    tasks, begin = [], time.perf_counter()
    for n in range(count * 2):
        await asyncio.sleep(max(0.0, begin + n / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    await client.close()
    if responder is not None:
        stop.set()
        await responder
    out = {"route": path, "worker": "echo" if stand_in else "tiny", "rate": rate,
           "client_ms": summary(times["client"]), "gateway_ms": summary(times["gateway"])}
    out["added_p50_ms"] = round(out["gateway_ms"]["p50"] - out["client_ms"]["p50"], 3)
    return out


async def echo(url: str, stop: asyncio.Event) -> None:
    """A stand-in worker (``--worker echo``): takes each request entry and publishes an ok result at once (a
    worker's answers to QUESTIONS, and their digest), through the library's publish function as a worker does, so
    that the latency phase measures the paths without the model's own time and its spread (tens of milliseconds on
    a shared CPU, against the one being measured). Its heartbeat says it serves MODEL (System One calls name it)."""
    import redis.asyncio as aioredis

    from producer.wire import library
    from producer.wire.keys import GROUP, Field, Keys
    from producer.wire.digest import digest
    from producer.wire.schema import parse_request

    keys, r = Keys(), aioredis.Redis.from_url(url)
    try:
        await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    except Exception:  # noqa: BLE001 - the group is there already
        pass
    beat = 0.0
    while not stop.is_set():
        if time.monotonic() - beat > 1:
            beat = time.monotonic()
            await r.hset(keys.workers(), "echo", json.dumps({"ts": time.time(), "inflight": 0, "model": MODEL,
                                                             "models": [MODEL], "engine": "echo"}))
        for _, entries in await r.xreadgroup(GROUP, "echo", {keys.requests: ">"}, count=256, block=100) or []:
            async with r.pipeline(transaction=False) as pipe:
                for entry_id, fields in entries:
                    request = parse_request(fields[Field.BODY.encode()])
                    result = json.dumps({"id": request.id, "status": "ok", "answers": ANSWERS, "model": MODEL,
                                         "usage": {"tokens": 40, "prompts": 1}, "digest": digest(request)})
                    pipe.fcall(library.PUBLISH, 3, keys.result(request.id), keys.shares(request.id),
                               keys.body(request.id), result, 600)
                    pipe.xack(keys.requests, GROUP, entry_id)
                    pipe.xdel(keys.requests, entry_id)
                await pipe.execute()
    await r.hdel(keys.workers(), "echo")
    await r.aclose()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(url: str, port: int, pid: int, seconds: float, connections: int, path: str) -> dict:
    """Calls answered (202 for /v1/requests, 200 with answers for /v1/systemone) per second of wall and gateway CPU
    time; /v1/systemone's calls each differ (identical ones within the retry window are one request)."""
    body = json.dumps({"state": "I was charged twice, refund me.", "questions": QUESTIONS}).encode()
    counts = {"answered": 0, "other": 0}
    stop, numbers = time.monotonic() + seconds + 2, iter(range(10**9))
    halt = asyncio.Event()
    responder = asyncio.create_task(echo(url, halt)) if path != "/v1/requests" else None

    async def loop(connection: Http) -> None:
        while time.monotonic() < stop:
            sent = body if path == "/v1/requests" else json.dumps(ROUTES[path](f"tp-{next(numbers)}")).encode()
            status, reply = await connection.post(path, sent)
            counts["answered" if (status == 202 if path == "/v1/requests" else answered(path, status, reply))
                   else "other"] += 1

    pool = [await Http(port).open() for _ in range(connections)]
    runners = [asyncio.create_task(loop(c)) for c in pool]
    await asyncio.sleep(2)  # warm-up: not counted
    before, cpu_before, started = dict(counts), cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*runners)
    wall, cpu = time.monotonic() - started, cpu_seconds(pid) - cpu_before
    if responder is not None:
        halt.set()
        await responder
    done = counts["answered"] - before["answered"]
    return {"route": path, "seconds": round(wall, 2), "connections": connections, "answered": done,
            "refused_or_failed": counts["other"] - before["other"], "per_second": round(done / wall),
            "gateway_cpu_seconds": round(cpu, 2), "per_cpu_second": round(done / cpu) if cpu else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for gateway.json and the logs")
    parser.add_argument("--requests", type=int, default=1000, help="decisions per path in the latency phase")
    parser.add_argument("--rate", type=float, default=100.0, help="decisions per second offered, both paths together")
    parser.add_argument("--worker", choices=("echo", "tiny"), default="echo",
                        help="who answers in the latency phase: a stand-in that answers at once (the gateway's "
                             "own cost, without the model's spread), or a real CPU worker on the tiny checkpoint")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the throughput phase")
    parser.add_argument("--connections", type=int, default=32, help="keep-alive connections, throughput phase")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    gateway_cpus, other_cpus = {cores[0]}, set(cores[1:]) or {cores[0]}
    os.sched_setaffinity(0, other_cpus)  # this process (the load) and what it starts, off the gateway's core
    from worker.model import tiny

    checkpoint = tiny.write(Path(tempfile.mkdtemp()) / "tiny", multimodal=False) if args.worker == "tiny" else None
    report: dict = {"cores": len(cores), "python": sys.version.split()[0]}
    with RedisServer(appendonly=False) as server:
        report["server"] = str(server.server)
        metrics, port = free_port(), free_port()
        worker = start([sys.executable, "-m", "worker", "serve", "--checkpoint", str(checkpoint), "--device", "cpu",
                        "--redis-url", server.url, "--metrics-port", str(metrics), "--served-model-name", MODEL],
                       out / "worker.log", other_cpus) \
            if args.worker == "tiny" else None
        gateway = start([sys.executable, "-m", "producer.gateway", "--redis-url", server.url, "--port", str(port),
                         "--max-unfinished", "0", "--log-level", "WARNING"], out / "gateway.log", set(cores))
        try:
            if worker is not None:
                wait_http(f"http://127.0.0.1:{metrics}/readyz")
            wait_http(f"http://127.0.0.1:{port}/health")
            report["latency"] = [asyncio.run(latency(server, port, args.requests, args.rate, worker is None, path))
                                 for path in ROUTES]
            if worker is not None:
                worker.terminate()
                worker.wait(60)
            os.sched_setaffinity(gateway.pid, gateway_cpus)  # one core to itself, the load on the others
            report["throughput"] = [asyncio.run(throughput(server.url, port, gateway.pid, args.seconds,
                                                           args.connections, path))
                                    for path in ("/v1/requests", "/v1/systemone")]
        finally:
            for process in (worker, gateway):
                if process is not None:
                    process.kill()
                    process.wait(10)
    (out / "gateway.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
