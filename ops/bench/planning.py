"""A lone request's planning on the CPU: what the worker does between taking an entry and queueing its prompt, in
pieces, with lone.py's requests (a 300-token state, three questions, the tiny checkpoint's tokenizer and template,
which the 2B benchmarks render with).

    python ops/bench/planning.py --requests 2000          # CPU figures of this machine, not an H100 host's

- plan: ``plan_entry`` alone (the body parsed, validated, its digest, rendered and tokenized), in this thread;
- here: ``Planner.submit(alone=True)`` with planner processes, awaited on an asyncio loop as the lifecycle awaits
  it: the plan in the worker's own thread, and the hops there and back;
- processes: the same entry sent to a planner process (``alone=False``), the hop the lone path avoids;
- read-out: one prompt's three answers from its head scores (the GPU thread's share of a lone request);
- vocabulary: what ``prepare_inputs`` paid per request before the encoder kept one copy of it (worker/model/
  encoder.py): a fast tokenizer's ``get_vocab`` at the tiny checkpoint's 512 tokens and at Qwen3.5's 248,320 (a
  word-level tokenizer of that size).

Prints one line per piece (p50 and mean of the wall time, microseconds; ``plan`` also its CPU time per request,
which the machine's other load moves less) and one ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def figures(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_us": round(1e6 * ordered[len(ordered) // 2], 1), "mean_us": round(1e6 * statistics.mean(ordered), 1)}


def vocabulary(tiny: int) -> dict[str, dict[str, float]]:
    """``get_vocab`` of a fast tokenizer of the tiny checkpoint's size and of Qwen3.5's."""
    from tokenizers import Tokenizer, models

    out = {}
    for size in (tiny, 248_320):
        tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
        times = []
        for _ in range(20):
            began = time.perf_counter()
            tokenizer.get_vocab(with_added_tokens=True)
            times.append(time.perf_counter() - began)
        out[f"get_vocab {size}"] = figures(times)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--planner-processes", type=int, default=2)
    args = parser.parse_args()

    import torch
    from lone import lone_requests
    from served import model_for

    from producer.wire.keys import NORMAL, Keys
    from worker.config import Settings
    from worker.entries import REQUESTS, Delivery, Job
    from worker.model.encoder import Encoder
    from worker.model.readout import answer, option_logits
    from worker.plan.planner import Planner, plan_entry

    torch.set_num_threads(1)
    model = model_for("tiny")
    settings = Settings(planner_processes=args.planner_processes)
    encoder = Encoder(model)
    keys = Keys()
    bodies = [json.dumps(request).encode() for request in lone_requests(args.requests, 2, encoder)]

    def delivery(index: int) -> Delivery:
        return Delivery.parse(REQUESTS, keys.requests_in(NORMAL), f"{index + 1}-0", {b"body": bodies[index]}, 1,
                              lane=NORMAL)

    out: dict[str, dict[str, float]] = {}
    jobs = [Job.of(delivery(i)) for i in range(len(bodies))]
    for job in jobs[:50]:  # warm: template compiled, tokenizer caches
        plan_entry(encoder, settings, job)
    times, cpu = [], time.process_time()
    for job in jobs:
        began = time.perf_counter()
        plan_entry(encoder, settings, job)
        times.append(time.perf_counter() - began)
    out["plan"] = {**figures(times), "cpu_us": round(1e6 * (time.process_time() - cpu) / len(jobs), 1)}

    planner = Planner(model, settings)
    planner.warmup()

    async def through(alone: bool) -> list[float]:
        spent = []
        for index in range(len(bodies)):
            began = time.perf_counter()
            await asyncio.wrap_future(planner.submit(delivery(index), alone=alone))
            spent.append(time.perf_counter() - began)
        return spent

    loop = asyncio.new_event_loop()
    try:
        out["here"] = figures(loop.run_until_complete(through(True))[50:])
        out["processes"] = figures(loop.run_until_complete(through(False))[50:])
    finally:
        loop.close()
        planner.shutdown()

    [prompt] = encoder.prompts(__import__("producer.wire.schema", fromlist=["Request"]).Request.model_validate(
        json.loads(bodies[0])))
    scores = torch.randn(len(prompt.questions), int(model.model.proj.out_features))
    times = []
    for _ in range(len(bodies)):
        began = time.perf_counter()
        [answer(model.decision_config, q, logits)
         for q, logits in zip(prompt.questions, option_logits(model, prompt.questions, scores))]
        times.append(time.perf_counter() - began)
    out["read-out"] = figures(times)
    out.update(vocabulary(len(getattr(model.processor, "tokenizer", model.processor).get_vocab())))
    for name, figure in out.items():
        cpu = f"   cpu {figure['cpu_us']:8.1f} us" if "cpu_us" in figure else ""
        print(f"{name:18} p50 {figure['p50_us']:9.1f} us   mean {figure['mean_us']:9.1f} us{cpu}")
    print("SUMMARY", json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
