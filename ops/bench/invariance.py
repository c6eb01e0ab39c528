"""Invariance: does a request's answer depend on what else rides in its pack, or on which worker computed it?

    python ops/bench/invariance.py --shape 2b --requests 3000 --out results/invariance-2b       # one GPU
    python ops/bench/invariance.py --shape tiny --requests 300 --planner-processes 0 --out /tmp/i  # CPU: the harness

A held-out set (standard requests, long-tail ones, and ones whose prompt is split by question and fanned out into
parts) is answered twice through Redis by the real daemon on the same random model (seeded):

1. alone: by a first worker process, one request at a time, so that each rides in a pack of its own (the smallest
   bucket that holds it; a fanned-out request's parts in packs of their own);
2. mixed: by a second worker process started afresh, the held-out requests enqueued at random places in a backlog
   of ``--requests`` others, so that they ride in full packs of the largest bucket at any position.

Reported per kind of request: how many came back with bitwise the same logits (the reply's JSON numbers are the
fp32 head scores exactly), and the largest logit and probability difference. Writes ``report.json`` in ``--out``
and prints one ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served import deterministic_of, model_for, serve_worker, worker_flags, worker_process  # noqa: E402
from traffic import QUESTIONS, make_requests  # noqa: E402

MAX_PROMPT_TOKENS = 2048  # the workers' longest prompt: a longer one is split by question
FANOUT_TOKENS = 3072  # the workers' fan-out threshold: a split request over it goes out in parts
# Six questions: a fanned-out request's prompt (state and every question) is over MAX_PROMPT_TOKENS; split, each of
# its prompts holds the state (about 1,900 tokens) and some questions, so any two are over FANOUT_TOKENS.
MANY_QUESTIONS = {f"{name}{copy}": question for copy in (1, 2) for name, question in QUESTIONS.items()}
KINDS = {"standard": ((256, 768), QUESTIONS), "long-tail": ((1200, 1900), QUESTIONS),
         "fanned-out": ((2150, 2250), MANY_QUESTIONS)}


def run_worker(args: argparse.Namespace) -> int:
    """A worker process: the real daemon around the seeded random model (both workers load the same weights)."""
    import torch

    def make_model() -> Any:
        torch.manual_seed(0)
        model = model_for(args.shape)
        model.max_length = MAX_PROMPT_TOKENS
        return model

    return serve_worker(args, make_model, fanout_tokens=FANOUT_TOKENS)


def held_out(args: argparse.Namespace, encoder) -> dict[str, list[dict]]:
    return {kind: [{**request, "id": f"held-{kind}-{index}"}
                   for index, request in enumerate(make_requests(count, 100 + seed, encoder, tokens, questions))]
            for seed, (kind, (tokens, questions)), count in zip(range(len(KINDS)), KINDS.items(),
                                                                  (args.standard, args.long_tail, args.fanned))}


def compare(alone, mixed) -> dict:
    """One request's two results: bitwise the same logits, and the largest logit and probability difference."""
    assert alone.ok and mixed.ok, (alone.error, mixed.error)
    logits = [abs(a - b) for name in alone.logits for a, b in zip(alone.logits[name], mixed.logits[name])]
    probabilities = [abs(a - b) for name in alone.probabilities
                     for a, b in zip(alone.probabilities[name], mixed.probabilities[name])]
    return {"identical": alone.logits == mixed.logits and alone.answers == mixed.answers,
            "logit": max(logits), "probability": max(probabilities), "parts": (alone.usage.parts, mixed.usage.parts)}


def run_bench(args: argparse.Namespace) -> int:
    import signal

    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stage timeout: unwind, stopping the worker too
    from producer.client import Client
    from worker.model import tiny
    from worker.model.encoder import Encoder
    from producer.local.server import RedisServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(tiny.rendering())
    held = held_out(args, encoder)
    dtype = "fp8" if args.fp8 else "bf16" if args.shape != "tiny" else "fp32"  # the tiny checkpoint is fp32
    report: dict = {"shape": args.shape, "dtype": dtype, "compile": args.compile,
                    "graphs": not args.no_graphs, "buckets": args.buckets,
                    "requests": args.requests,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"}
    with RedisServer("--appendfsync", "everysec") as server:
        with worker_process(__file__, args, server.url, out_dir / "worker-alone.log") as (port, ready):
            report["worker_start_seconds"] = [ready]
            report["deterministic"] = deterministic_of(port)  # as the worker decided
            with Client(server.url, max_unfinished=0) as client:
                alone = {request["id"]: client.decide(request, timeout=args.timeout)
                         for requests in held.values() for request in requests}
        # Results are stored under their ids: the second round asks again under new ids.
        backlog = make_requests(args.requests, 1, encoder)
        rng = random.Random(7)
        for requests in held.values():
            for request in requests:
                backlog.insert(rng.randint(0, len(backlog)), {**request, "id": "again-" + request["id"]})
        with worker_process(__file__, args, server.url, out_dir / "worker-mixed.log") as (_, ready):
            report["worker_start_seconds"].append(ready)
            with Client(server.url, max_unfinished=0) as client:
                mixed = client.wait_many(client.submit_many(backlog), timeout=args.timeout)
    report["kinds"] = {}
    for kind, requests in held.items():
        pairs = [compare(alone[r["id"]], mixed["again-" + r["id"]]) for r in requests]
        report["kinds"][kind] = {
            "requests": len(pairs), "identical": sum(p["identical"] for p in pairs),
            "max_logit_difference": max((p["logit"] for p in pairs), default=0.0),
            "max_probability_difference": max((p["probability"] for p in pairs), default=0.0),
            "parts": sorted({p["parts"][0] for p in pairs})}
    report["identical"] = sum(k["identical"] for k in report["kinds"].values())
    report["held_out"] = sum(k["requests"] for k in report["kinds"].values())
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("SUMMARY", json.dumps({k: report[k] for k in ("shape", "dtype", "deterministic", "held_out", "identical",
                                                        "kinds")}),
          flush=True)
    fanned = report["kinds"]["fanned-out"]
    if fanned["requests"] and fanned["parts"] == [1]:
        raise SystemExit("the fanned-out requests were not fanned out: the harness no longer tests what it says")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker_flags(parser)
    parser.add_argument("--requests", type=int, default=3000, help="the backlog the held-out set is mixed into")
    parser.add_argument("--standard", type=int, default=24, help="held-out standard requests")
    parser.add_argument("--long-tail", type=int, default=8, help="held-out long-tail requests")
    parser.add_argument("--fanned", type=int, default=2, help="held-out requests split and fanned out into parts")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for one phase's results")
    parser.add_argument("--out", default="invariance-results")
    args = parser.parse_args()
    return run_worker(args) if args.worker else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
