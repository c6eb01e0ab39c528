"""A lone caller: one request at a time, the next sent once the last is answered (an agent's step, an interactive
check), through Redis with the producer's client and through the gateway's ``POST /v1/decide``; and where its time
goes.

    python ops/bench/lone.py --shape 2b --out OUT/lone-2b-bf16                        # one GPU
    python ops/bench/lone.py --shape tiny --planner-processes 0 --out /tmp/lone       # CPU: the harness

One Redis, one worker process (the real daemon around a random model, as end_to_end.py starts it) and one gateway
process. Every request has a 300-token state and three questions (noul, a 4-way choice, a 5-level score). After a
warm-up, two phases of ``--requests`` each:

1. client: ``Client.submit`` then ``Client.wait``, timed by the caller (the client's view);
2. gateway: ``POST /v1/decide`` on one keep-alive connection, timed by the caller.

The breakdown of phase 1 (means per request): enqueue (the submit call), read (enqueue to taken by the worker,
``dq_queue_wait_seconds`` less the half millisecond its start is early by: an entry id counts whole ms), then the
worker's states (``dq_request_state_seconds``): planning, queued (waiting for a
pack), computing (the pack on the GPU, to its answers read out); publish and read back is the rest of the client's
view (the hop to the worker's Redis thread, the publication, the client's blocked read waking, parsing). Writes
``report.json`` in ``--out`` and prints one ``SUMMARY`` line; ``ops/bench/plot.py --lone`` draws the breakdown.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served import deterministic_of, serve_worker, worker_flags, worker_process  # noqa: E402
from traffic import STATES, gc_collections, make_requests, percentile, scrape  # noqa: E402

STATE_TOKENS = 300
TARGETS = {"p50_ms": 15, "p99_ms": 25}  # issue 40, the client's view


def run_worker(args: argparse.Namespace) -> int:
    return serve_worker(args)


def lone_requests(count: int, seed: int, encoder) -> list[dict]:
    """Requests whose state has about STATE_TOKENS tokens (the rendered prompt adds the template and questions)."""
    from producer.wire.schema import Request
    from traffic import QUESTIONS

    empty = encoder.prompts(Request.model_validate({"state": "", "questions": QUESTIONS}))[0].length
    return make_requests(count, seed, encoder, tokens=(empty + STATE_TOKENS, empty + STATE_TOKENS))


def summary(ms: list[float]) -> dict[str, float]:
    return {"count": len(ms), "p50_ms": round(percentile(ms, 0.5), 2), "p99_ms": round(percentile(ms, 0.99), 2),
            "mean_ms": round(sum(ms) / max(1, len(ms)), 2), "max_ms": round(max(ms, default=float("nan")), 2)}


def mean_ms(before: dict, after: dict, name: str, labels: str = "") -> float:
    """The mean of a histogram over a phase, in ms (``labels`` as ``scrape`` keys them: ``{lane=normal}``)."""
    total = after.get(f"{name}_sum{labels}", 0.0) - before.get(f"{name}_sum{labels}", 0.0)
    count = after.get(f"{name}_count{labels}", 0.0) - before.get(f"{name}_count{labels}", 0.0)
    return round(1000 * total / count, 3) if count else float("nan")


def breakdown(before: dict, after: dict, enqueue: list[float], total: list[float]) -> dict[str, float]:
    """Mean ms per request in each step of its way; the rest of the client's view is the publication and the read
    back (the worker's own settling, answers read out to its publish call returned, overlaps the client's wake)."""
    # An entry id counts whole milliseconds: the wait measured from it starts on average half a millisecond early.
    steps = {"enqueue": round(sum(enqueue) / len(enqueue), 3),
             "read": round(mean_ms(before, after, "dq_queue_wait_seconds", "{lane=normal}") - 0.5, 3)}
    for state in STATES[:-1]:
        steps[state] = mean_ms(before, after, "dq_request_state_seconds", f"{{lane=normal}}{{state={state}}}")
    steps["publish and read back"] = round(sum(total) / len(total) - sum(steps.values()), 3)
    return steps


def packs(before: dict, after: dict) -> dict[str, int]:
    """Forward passes over the phase by static pack size."""
    prefix = "dq_forward_seconds_count{size="
    return {key[len(prefix):-1]: int(after[key] - before.get(key, 0.0)) for key in after
            if key.startswith(prefix) and after[key] > before.get(key, 0.0)}


def client_phase(url: str, port: int, requests: list[dict]) -> dict:
    from producer.client import Client

    enqueue, total = [], []
    with Client(url, max_unfinished=0) as client:
        before = scrape(port)
        for request in requests:
            began = time.perf_counter()
            request_id = client.submit(request)
            sent = time.perf_counter()
            assert client.wait(request_id, timeout=60).ok
            ended = time.perf_counter()
            enqueue.append((sent - began) * 1000)
            total.append((ended - began) * 1000)
        after = scrape(port)
    return {**summary(total), "breakdown_ms": breakdown(before, after, enqueue, total), "packs": packs(before, after),
            "pack_gpu_ms": mean_ms(before, after, "dq_pack_gpu_seconds"),
            "planner_ms": mean_ms(before, after, "dq_planning_seconds"),
            "settling_ms": mean_ms(before, after, "dq_request_state_seconds", "{lane=normal}{state=settling}"),
            "gc_collections": gc_collections(before, after)}


def gateway_phase(port: int, requests: list[dict]) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    total = []
    for request in requests:
        body = json.dumps({k: v for k, v in request.items() if k != "id"}).encode()
        began = time.perf_counter()
        connection.request("POST", "/v1/decide", body, {"content-type": "application/json"})
        reply = connection.getresponse()
        payload = reply.read()
        total.append((time.perf_counter() - began) * 1000)
        assert reply.status == 200 and json.loads(payload)["status"] == "ok", payload[:300]
    connection.close()
    return summary(total)


def start_gateway(url: str, log_path: Path) -> tuple[subprocess.Popen, int]:
    from gateway import wait_http

    from producer.local.ports import free_port

    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "producer.gateway", "--redis-url", url, "--port", str(port),
                                    "--max-unfinished", "0", "--log-level", "WARNING"], stdout=log,
                                   stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
    return process, port


def run_bench(args: argparse.Namespace) -> int:
    import signal

    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stage timeout: unwind, stopping the worker too
    from producer.local.server import RedisServer
    from producer.wire.schema import Request
    from worker.model import tiny
    from worker.model.encoder import Encoder

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(tiny.rendering())
    report: dict = {"shape": args.shape, "dtype": "fp8" if args.fp8 else "bf16", "buckets": args.buckets,
                    "max_wait_ms": args.max_wait_ms, "planner_processes": args.planner_processes,
                    "state_tokens": STATE_TOKENS, "targets": TARGETS,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"}
    with RedisServer("--appendfsync", "everysec") as server, \
            worker_process(__file__, args, server.url, out_dir / "worker.log") as (port, ready_seconds):
        report["worker_start_seconds"] = ready_seconds
        report["deterministic"] = deterministic_of(port)  # as the worker decided
        gateway, gateway_port = start_gateway(server.url, out_dir / "gateway.log")
        try:
            warm = lone_requests(args.warmup, 1, encoder)
            client_phase(server.url, port, warm)
            gateway_phase(gateway_port, warm)
            requests = lone_requests(args.requests, 2, encoder)
            report["prompt_tokens"] = round(sum(prompt.length for r in requests[:50]
                                                for prompt in encoder.prompts(Request.model_validate(r))) / 50)
            report["client"] = client_phase(server.url, port, requests)
            print("client", report["client"], flush=True)
            report["gateway"] = gateway_phase(gateway_port, lone_requests(args.requests, 3, encoder))
            print("gateway", report["gateway"], flush=True)
        finally:
            gateway.terminate()
            gateway.wait(30)
    client = report["client"]
    report["met"] = {"p50_ms": client["p50_ms"] <= TARGETS["p50_ms"], "p99_ms": client["p99_ms"] <= TARGETS["p99_ms"]}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("SUMMARY", json.dumps({
        "client": {k: client[k] for k in ("p50_ms", "p99_ms", "mean_ms", "max_ms")},
        "gateway": {k: report["gateway"][k] for k in ("p50_ms", "p99_ms", "mean_ms", "max_ms")},
        "breakdown_ms": client["breakdown_ms"], "packs": client["packs"], "pack_gpu_ms": client["pack_gpu_ms"],
        "planner_ms": client["planner_ms"], "settling_ms": client["settling_ms"],
        "prompt_tokens": report["prompt_tokens"], "met": report["met"], "start_s": ready_seconds}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_flags(parser)
    parser.add_argument("--requests", type=int, default=1000, help="requests of each phase, one at a time")
    parser.add_argument("--warmup", type=int, default=50, help="requests through each path before timing")
    parser.add_argument("--out", default="lone-results")
    args = parser.parse_args()
    return run_worker(args) if args.worker else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
