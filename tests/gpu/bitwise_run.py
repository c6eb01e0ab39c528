"""One worker-like process for tests/gpu/test_bitwise.py: loads a checkpoint, starts the fast engine (warm-up and
all), runs a held-out set of prompts alone and inside packs of random traffic (first, last, in the middle, in
every bucket), and saves every held-out prompt's scores per composition.

Usage: python bitwise_run.py CHECKPOINT OUT.pt [--deterministic] [--fp8] [--seed N] [--cache DIR] [--cpu]
[--epilogues LIST]
``--seed``: the random traffic (two processes given other seeds share only the held-out set). ``--cache``: the
process's own compile cache (no process loads another's kernels or their tuning). ``--cpu``: the stand-ins
(plain-torch mixers, plain calls for graphs) on the CPU, to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BUCKETS = (512, 1024, 2048)
QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure", "sad": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["none", "low", "medium", "high", "now"]},
}


def requests(corpus: list[str], rng: random.Random, count: int, longest: int) -> list[dict]:
    """Text requests of 1 to ``longest`` corpus sentences and 1 to 3 questions."""
    out = []
    for _ in range(count):
        names = rng.sample(sorted(QUESTIONS), rng.randint(1, 3))
        state = " ".join(rng.choice(corpus) for _ in range(rng.randint(1, longest)))
        out.append({"state": state, "questions": {name: QUESTIONS[name] for name in names}})
    return out


def held_out(corpus: list[str]) -> dict[str, list[dict]]:
    """The requests every process answers: standard, long-tail (one over the largest bucket: always alone, on the
    eager path), with images, and one long enough to be split over several prompts (as a fanned-out request is)."""
    from support import png

    rng = random.Random(0)
    long_state = " ".join(corpus[i % len(corpus)] for i in range(35))
    images = {f"img-{i}": {"data_base64": png(color, size)}
              for i, (color, size) in enumerate([("red", (64, 64)), ("blue", (96, 32))])}
    return {
        "standard": requests(corpus, rng, 8, 12),
        "long-tail": [{"state": " ".join(corpus[i % len(corpus)] for i in range(n)), "questions": QUESTIONS}
                      for n in (12, 30, 62)],
        "images": [{"state": "Look: img-0, then img-1. " + corpus[3], "questions": QUESTIONS, "assets": images}],
        "split": [{"state": long_state, "questions": {f"{name}-{i}": QUESTIONS[name] for i in range(12)
                                                       for name in QUESTIONS}}],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache", default="")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--epilogues", default="")
    args = parser.parse_args()
    if args.deterministic:
        from worker.fast import deterministic

        deterministic.prepare_process()  # before the first GPU matmul, as the daemon does
    import torch

    from producer.wire.schema import Request
    from worker.config import Settings
    from worker.fast import FastEngine
    from worker.model import checkpoint, tiny
    from worker.model.encoder import Encoder

    device, dtype = ("cpu", "float32") if args.cpu else ("cuda", "bfloat16")
    model = checkpoint.load(args.checkpoint, device=device, dtype=dtype, max_prompt_tokens=2560)
    settings = Settings(deterministic=args.deterministic, fp8=args.fp8, buckets=",".join(map(str, BUCKETS)),
                        pack_tokens=max(BUCKETS), max_prompt_tokens=2560, compile="none" if args.cpu else "layer",
                        compile_cache=args.cache, epilogues=args.epilogues)
    extra = {}
    if args.cpu:
        from worker.fast.mixers import TorchMixers

        extra = dict(mixers=TorchMixers(), capture=(lambda piece: piece, lambda piece: piece()))
    began = time.perf_counter()
    engine = FastEngine(model, settings, **extra)
    engine.warmup()
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    print(f"engine ready in {time.perf_counter() - began:.1f}s, {graphs} compiled graphs", flush=True)

    encoder = Encoder(model)
    corpus = list(tiny.CORPUS)
    kept = {kind: [prompt for request in group for prompt in encoder.prompts(Request.model_validate(request))]
            for kind, group in held_out(corpus).items()}
    print({kind: [p.length for p in prompts] for kind, prompts in kept.items()}, flush=True)
    assert len(kept["split"]) > 1, "the split request must span several prompts"
    assert max(p.length for p in kept["long-tail"]) > max(BUCKETS), "one long-tail prompt runs alone, eagerly"
    rng = random.Random(args.seed)
    from support import png

    pictures = [{"state": f"See img-0. {rng.choice(corpus)}", "questions": {"tone": QUESTIONS["tone"]},
                 "assets": {"img-0": {"data_base64": png(color, (rng.choice((32, 64, 96)), rng.choice((32, 64))))}}}
                for color in ("green", "white", "black", "yellow")]  # other images beside the held-out one
    traffic = [prompt for request in requests(corpus, rng, 200, 20) + pictures * 5
               for prompt in encoder.prompts(Request.model_validate(request))]

    shortest = [prompt for word in ("ok", "hello", "refund please", "thanks", "where is it", "stop")
                for name in QUESTIONS
                for prompt in encoder.prompts(Request.model_validate({"state": word,
                                                                      "questions": {name: QUESTIONS[name]}}))] * 8

    def run(pack: list, at: int) -> torch.Tensor:
        result = engine.launch(pack).wait()
        assert result.graph or len(pack) == 1, "every pack within the budget runs from its bucket's graphs"
        return result.scores[at].clone()

    def filled(target, low: int, high: int) -> list:
        """Random traffic beside ``target`` until the pack holds more than ``low`` tokens (at most ``high``)."""
        crowd, used = [], target.length
        for _ in range(10_000):
            if used > low:
                return crowd
            other = rng.choice(traffic)
            if used + other.length <= high:
                crowd.append(other)
                used += other.length
        raise AssertionError(f"no pack of {low + 1} to {high} tokens around a prompt of {target.length}")

    scores: dict[str, dict[str, torch.Tensor]] = {}
    for kind, prompts in kept.items():
        for number, prompt in enumerate(prompts):
            key, got = f"{kind}-{number}", {}
            got["alone"] = run([prompt], 0)
            if prompt.length <= max(BUCKETS):
                for low, high in zip((0, *BUCKETS[:-1]), BUCKETS):
                    if prompt.length > high:
                        continue
                    crowd = filled(prompt, max(low, prompt.length), high)
                    got[f"first in {high}"] = run([prompt, *crowd], 0)
                    got[f"last in {high}"] = run([*crowd, prompt], len(crowd))
                    at = rng.randint(0, len(crowd))
                    got[f"among others in {high}"] = run([*crowd[:at], prompt, *crowd[at:]], at)
                # Many short prompts: the delta rule's kernel takes its widest tile (a grid of prompts x heads
                # filling the card), where alone it takes its narrowest.
                crowd, used = [], prompt.length
                for other in shortest:
                    if used + other.length > max(BUCKETS):
                        break
                    crowd.append(other)
                    used += other.length
                got[f"among {len(crowd)} short ones"] = run([*crowd[:5], prompt, *crowd[5:]], min(5, len(crowd)))
            scores[key] = got
    torch.save({"graphs": graphs, "recompiled": counters["stats"]["unique_graphs"] - graphs,
                "scores": {key: {label: value.cpu() for label, value in got.items()} for key, got in scores.items()}},
               args.out)
    print(f"saved {sum(len(got) for got in scores.values())} scores of {len(scores)} held-out prompts", flush=True)


if __name__ == "__main__":
    main()
