"""The pack policy, simulated: the gate's latency targets on a virtual clock, for this tree's GPU stage and an
earlier commit's, side by side. SIMULATED, NOT MEASURED: the real packer and GPU loop (worker/gpu/) run against a
modelled host and GPU (ops/bench/sim_worker.py, fitted to the H100 figures of docs/BENCHMARKS.md); the figures say
what the policy does with those costs, never what a GPU will measure.

    python ops/bench/simulate.py --before acbedcd                 # the table: acbedcd's packer against this tree's
    python ops/bench/simulate.py --arrivals poisson --seeds 3     # Poisson arrivals (the benchmarks pace evenly)

Each scenario is a fresh simulated worker, as the benchmarks start fresh workers (ops/bench/run_all.sh):

- peak (end_to_end.py): 256 requests to warm, then a backlog of ``--requests`` (256-768 tokens) at once; tokens over
  first enqueue to last result, against the same prompts in greedy full packs back to back (the in-process figure);
- sweep: then, in the same worker, ``--seconds`` of requests at each load (x the peak's requests/s), p50/p99 of
  enqueue to result, and where p99 crosses 50 and 100 ms;
- priority (priority.py): the peak, then a ``--requests`` normal backlog with high requests at 10% of the peak rate
  until it is answered: high p50/p99, the normal lane's throughput over the peak;
- lone (lone.py): 1000 requests of 464 tokens one at a time, the client's view.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_worker import HIGH, NORMAL, Costs, Request, Worker, percentile  # noqa: E402

LOADS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0)


def lengths(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(256, 768) for _ in range(count)]  # traffic.make_requests' standard prompts


def backlog(worker: Worker, tokens: list[int], lane: str = NORMAL) -> list[Request]:
    requests = [Request(n, lane) for n in tokens]
    for request in requests:
        worker.sim.enqueue(request)
    return requests


def peak(worker: Worker, rng: random.Random, count: int) -> dict:
    """Warm-up, then a backlog at once: end to end against greedy full packs back to back."""
    warm = backlog(worker, lengths(rng, 256))
    worker.run(lambda: all(r.done for r in warm))
    tokens = lengths(rng, count)
    requests = backlog(worker, tokens)
    worker.run(lambda: all(r.done for r in requests))
    seconds = max(r.done for r in requests) - min(r.enqueued for r in requests)
    packs, used, budget = 1, 0, worker.sizes[-1]
    for n in tokens:  # synthetic.packs: greedy in arrival order
        if used and used + n > budget:
            packs, used = packs + 1, 0
        used += n
    in_process = sum(tokens) / (packs * worker.costs.gpu(budget))
    return {"tokens_per_s": round(sum(tokens) / seconds), "requests_per_s": round(count / seconds, 1),
            "in_process_tokens_per_s": round(in_process), "ratio": round(sum(tokens) / seconds / in_process, 3)}


def paced(worker: Worker, rng: random.Random, rate: float, seconds: float, arrivals: str,
          lane: str = NORMAL, until=None, after: float = 0.0) -> list[Request]:
    """Requests at ``rate`` per second (evenly, as the benchmarks pace them, or Poisson) for ``seconds`` or until
    ``until()``, the first ``after`` seconds from now; scheduled on the simulation's clock."""
    sim, start, out = worker.sim, worker.sim.t + after, []
    when = start
    while when < start + seconds:
        request = Request(rng.randint(256, 768), lane)
        out.append(request)
        sim.at(when, lambda r=request: None if until and until() else sim.enqueue(r))
        when += rng.expovariate(rate) if arrivals == "poisson" else 1 / rate
    return out


def sweep(worker: Worker, rng: random.Random, rate: float, seconds: float, arrivals: str) -> list[dict]:
    out = []
    for load in LOADS:
        requests = paced(worker, rng, load * rate, seconds, arrivals)
        worker.run(lambda: all(r.done for r in requests))
        ms = [1000 * (r.done - r.enqueued) for r in requests]
        out.append({"load": load, "p50_ms": round(percentile(ms, 0.5), 1), "p99_ms": round(percentile(ms, 0.99), 1),
                    "max_ms": round(max(ms), 1)})
    return out


def crossing(points: list[dict], limit: float) -> float:
    """The highest load up to which p99 stays within ``limit`` ms."""
    best = 0.0
    for point in points:
        if point["p99_ms"] > limit:
            break
        best = point["load"]
    return best


def priority(worker: Worker, rng: random.Random, count: int, arrivals: str) -> dict:
    top = peak(worker, rng, count)
    warm = backlog(worker, lengths(rng, 16), HIGH)
    worker.run(lambda: all(r.done for r in warm))
    # priority.py makes the phase's requests and scrapes the worker between the warm-up and the backlog: the
    # high lane has been quiet for seconds when the backlog and the first high requests come
    worker.sim.run_until(worker.sim.t + 2.0)
    normal = backlog(worker, lengths(rng, count))
    began = worker.sim.t
    # the high feeder starts once the backlog's submission returns (about 0.2 s for 3000 requests)
    high = paced(worker, rng, 0.1 * top["requests_per_s"], 600.0, arrivals, HIGH,
                 until=lambda: all(r.done for r in normal), after=0.2)
    worker.run(lambda: all(r.done for r in normal))
    sent = [r for r in high if r.enqueued]
    worker.run(lambda: all(r.done for r in sent))
    end = max(r.done for r in normal)
    seconds = end - began
    ms = [1000 * (r.done - r.enqueued) for r in sent]
    normal_rate = sum(r.tokens for r in normal) / seconds
    high_tokens = sum(r.tokens for r in sent if r.enqueued <= end)
    return {"high_p50_ms": round(percentile(ms, 0.5), 1), "high_p99_ms": round(percentile(ms, 0.99), 1),
            "high_max_ms": round(max(ms), 1), "high_requests": len(ms),
            "normal_over_peak": round(normal_rate / top["tokens_per_s"], 3),
            "total_over_peak": round((normal_rate + high_tokens / seconds) / top["tokens_per_s"], 3)}


def lone(worker: Worker, count: int = 1000, tokens: int = 464) -> dict:
    """One at a time, the next sent once the last is answered: the client's view adds its submit and its wake."""
    sim, costs, requests = worker.sim, worker.costs, []

    def send() -> None:
        if len(requests) < count:
            requests.append(Request(tokens))
            sim.at(sim.t + costs.wake + costs.enqueue, lambda: sim.enqueue(requests[-1]))

    sim.on_done = lambda request: send()
    send()
    worker.run(lambda: len(requests) == count and requests[-1].done > 0)
    ms = [1000 * (costs.enqueue + r.done - r.enqueued + costs.wake) for r in requests[50:]]
    return {"p50_ms": round(percentile(ms, 0.5), 2), "p99_ms": round(percentile(ms, 0.99), 2)}


def scenarios(commit: str | None, args: argparse.Namespace, seed: int) -> dict:
    settings = json.loads(args.settings) if args.settings and commit is None else {}
    costs = Costs(launch_spread=args.launch_spread)
    make = lambda: Worker(costs, commit, settings=settings)  # noqa: E731 - a fresh worker per scenario
    rng = random.Random(seed)
    worker = make()
    top = peak(worker, rng, args.requests)
    points = sweep(worker, rng, top["requests_per_s"], args.seconds, args.arrivals)
    half = next(p for p in points if p["load"] == 0.5)
    return {"peak": top, "sweep": points, "p99_half_ms": half["p99_ms"], "load_p99_50": crossing(points, 50),
            "load_p99_100": crossing(points, 100),
            "priority": priority(make(), random.Random(seed + 1), args.requests, args.arrivals), "lone": lone(make())}


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(results: dict[str, list[dict]]) -> str:
    """One row per target, one column per GPU stage simulated: the median over the seeds of each figure."""
    names = list(results)

    def cell(name: str, get) -> str:
        return f"{median([get(run) for run in results[name]]):g}"

    rows = [("p99 at half the peak, ms", lambda r: r["p99_half_ms"], "<= 50"),
            ("highest load with p99 <= 100 ms", lambda r: r["load_p99_100"], ">= 0.8"),
            ("highest load with p99 <= 50 ms", lambda r: r["load_p99_50"], "-"),
            ("end to end / in process", lambda r: r["peak"]["ratio"], ">= 0.97"),
            ("high p99, ms", lambda r: r["priority"]["high_p99_ms"], "<= 150"),
            ("high max, ms", lambda r: r["priority"]["high_max_ms"], "-"),
            ("normal lane / peak", lambda r: r["priority"]["normal_over_peak"], ">= 0.85"),
            ("lone p50, ms", lambda r: r["lone"]["p50_ms"], "<= 10"),
            ("lone p99, ms", lambda r: r["lone"]["p99_ms"], "<= 15")]
    out = ["| target (simulated) | " + " | ".join(names) + " | target |", "|---" * (len(names) + 2) + "|"]
    for label, get, target in rows:
        out.append(f"| {label} | " + " | ".join(cell(name, get) for name in names) + f" | {target} |")
    out += ["", "| load | " + " | ".join(f"{name}: p50 / p99 ms" for name in names) + " |",
            "|---" * (len(names) + 1) + "|"]
    for i, load in enumerate(LOADS):
        out.append(f"| {load} | " + " | ".join(
            cell(name, lambda r: r["sweep"][i]["p50_ms"]) + " / " + cell(name, lambda r: r["sweep"][i]["p99_ms"])
            for name in names) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="an earlier commit whose worker/gpu/ is simulated beside this tree's")
    parser.add_argument("--arrivals", choices=("even", "poisson"), default="even",
                        help="paced evenly, as the benchmarks send (default), or Poisson")
    parser.add_argument("--seeds", type=int, default=3, help="runs per stage, each figure their median")
    parser.add_argument("--requests", type=int, default=3000, help="the peak's backlog (run_all.sh: 3000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each load's phase (run_all.sh: 10)")
    parser.add_argument("--settings", default="", help="this tree's worker settings as JSON, e.g. "
                                                       "'{\"high_target_ms\": 120}'")
    parser.add_argument("--launch-spread", type=float, default=0.0,
                        help="each launch's host time times e^N(0, this): a host that pauses (0: never)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    stages = ([(f"{args.before} (before)", args.before)] if args.before else []) + [("this tree", None)]
    results = {name: [scenarios(commit, args, seed) for seed in range(args.seeds)] for name, commit in stages}
    print(f"SIMULATED ({args.arrivals} arrivals, launch spread {args.launch_spread}, {args.seeds} seeds, medians), "
          "not measured:")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
