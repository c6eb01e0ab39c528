"""The host's own ceiling: requests per second through Redis and the real daemon when the engine computes nothing,
and the CPU each of the worker's threads spends per request. What a GPU worker's host must do between packs at its
peak (about 380 requests/s at the 2B shape on an H100), measured without a GPU.

    python ops/bench/host_ceiling.py --requests 3000 --planner-processes 2     # CPU figures of this machine

One process: the daemon (intake, planner processes, lifecycle, settle, the GPU loop) around an engine whose packs
are answered at once (zero scores), the tiny checkpoint's tokenizer and template (the 2B benchmarks'), a local
Redis holding a backlog of standard requests (256-768 tokens) submitted before the worker starts. Prints the pace
of the backlog's results (requests per second), each thread's CPU milliseconds per request once warm (the planner
processes' apart), and one ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class NullEngine:
    """A pack answered at once: zero scores per question, nothing computed."""

    name = "null"
    deterministic = False

    def __init__(self, verbalizers: int, budget: int = 16384) -> None:
        self.verbalizers, self.max_pack_tokens = verbalizers, budget
        self.pack_sizes = (512, 1024, 2048, 4096, 8192, 16384)

    def warmup(self) -> None:
        pass

    def launch(self, prompts):
        import torch

        from worker.model.engine import PackRun, Pending

        tokens = sum(prompt.length for prompt in prompts)
        run = PackRun([torch.zeros(len(p.questions), self.verbalizers) for p in prompts], tokens, tokens, None,
                      False, 0.0)
        return Pending(lambda: run, finished=lambda: True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, by Python thread name (Linux; "other": threads
    Python did not start, such as torch's and the tokenizer's)."""
    ticks = os.sysconf("SC_CLK_TCK")
    names = {thread.native_id: thread.name.split("_")[0].rstrip("-0123456789") or thread.name
             for thread in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--planner-processes", type=int, default=2)
    args = parser.parse_args()

    from served import model_for
    from traffic import make_requests

    from producer.client import Client
    from producer.local.server import RedisServer
    from worker.config import Settings
    from worker.daemon import Daemon
    from worker.logs import setup_logging
    from worker.model.encoder import Encoder

    setup_logging("text", "WARNING")
    model = model_for("tiny")
    encoder = Encoder(model)
    with RedisServer("--appendfsync", "everysec") as server:
        settings = Settings(checkpoint="(tiny)", device="cpu", engine="reference", redis_url=server.url,
                            planner_processes=args.planner_processes, read_count=128, max_inflight=1024,
                            claim_idle_ms=600_000)
        daemon = Daemon(settings, model=model)
        daemon.compute.engine = daemon.engine = NullEngine(int(model.model.proj.out_features))
        client = Client(server.url, max_unfinished=0)
        warm = client.submit_many(make_requests(256, 2, encoder))  # all queued before the worker starts: a backlog
        ids = client.submit_many(make_requests(args.requests, 1, encoder))
        results: dict = {}

        def watch() -> None:  # the CPU of each thread while the backlog after the warm-up is computed
            computed = daemon.metrics.prompts._value.get
            while computed() < len(warm):
                time.sleep(0.01)
            results["before"] = thread_cpu()
            while computed() < len(warm) + len(ids) or daemon.loop.held:
                time.sleep(0.01)
            results["after"] = thread_cpu()
            daemon.stop()

        watcher = threading.Thread(target=watch, name="watch")
        watcher.start()
        daemon.run()
        watcher.join()
        results["done"] = client.wait_many(ids, timeout=60)
    done = [r for r in results["done"].values() if r.ok]
    finished = sorted(r.timings.finished_ms for r in done)
    seconds = (finished[-1] - finished[0]) / 1000  # the backlog was there from the start: its results' pace
    cpu = {name: round(1000 * (results["after"].get(name, 0.0) - results["before"].get(name, 0.0)) / len(done), 3)
           for name in results["after"]}
    cpu = {name: ms for name, ms in sorted(cpu.items(), key=lambda kv: -kv[1]) if ms > 0}
    figures = {"requests": len(done), "requests_per_s": round(len(done) / seconds, 1),
               "cpu_ms_per_request": cpu, "cpus": os.cpu_count()}
    print(f"{figures['requests_per_s']} requests/s; CPU ms per request by thread: {cpu}")
    print("SUMMARY", json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
