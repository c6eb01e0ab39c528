"""The benchmarks' traffic and readings: System One requests whose prompts have a chosen number of tokens, and what
a phase reads back (the worker's metrics scraped, percentiles, the GPU's busy time, garbage collections, Redis'
delayed fsyncs).
"""

from __future__ import annotations

import random
import urllib.request

from worker.metrics import STATES  # a computed entry's states, as dq_request_state_seconds names them

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this message spam?"},
    "topic": {"type": "choice", "instructions": "What is it about?",
              "criteria": {"billing": None, "delivery": None, "account": None, "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["none", "low", "medium", "high", "critical"]},
}
WORDS = ("the customer was charged twice for the order and the parcel arrived damaged please send a refund today "
         "account billing delivery message urgent help support team reply week month phone free offer").split()



def make_requests(count: int, seed: int, encoder, tokens: tuple[int, int] = (256, 768),
                  questions: dict = QUESTIONS) -> list[dict]:
    """Requests whose rendered prompts have ``tokens`` tokens (uniform; standard: 256-768)."""
    from producer.wire.schema import Request

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
    """The packs' own GPU time and the GPU's idle time between packs over a phase (engine-measured, CUDA events),
    and a launch's mean host time (a host too slow to launch a pack before the one ahead of it ends stretches it)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    busy, idle = delta("dq_pack_gpu_seconds_sum"), delta("dq_gpu_idle_seconds_sum")
    launches = delta("dq_pack_launch_seconds_count")
    return {"gpu_busy_fraction": round(busy / seconds, 3), "gpu_idle_between_packs_s": round(idle, 2),
            "packs": int(delta("dq_pack_gpu_seconds_count")),
            "launch_ms_mean": round(1000 * delta("dq_pack_launch_seconds_sum") / launches, 2) if launches else None}


def gc_collections(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The worker's garbage collections over a phase, by generation (a full one, generation 2, stops every thread
    of the process while it walks what start-up did not freeze)."""
    return {generation: int(after.get(f"python_gc_collections_total{{generation={generation}}}", 0)
                            - before.get(f"python_gc_collections_total{{generation={generation}}}", 0))
            for generation in ("0", "1", "2")}


def _labels(key: str) -> dict[str, str]:
    """A ``scrape`` key's labels: ``name{a=1}{b=2}`` -> {a: 1, b: 2}."""
    return dict(part.split("=", 1) for part in key[key.index("{") + 1:-1].split("}{")) if "{" in key else {}


def slowest_ms(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> str:
    """The bucket of histogram ``name``'s slowest observation (with these labels) over a phase: a stall shows
    here."""
    edges = []
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{"):
            found = _labels(key)
            if all(found.get(k) == v for k, v in labels.items()):
                edges.append((float(found["le"]), value - before.get(key, 0.0)))
    edges.sort()
    total = edges[-1][1] if edges else 0
    below = [le for le, count in edges if count >= total]
    return f"<= {below[0] * 1000:g}" if below and total else "-"


def slowest_pack_ms(before: dict[str, float], after: dict[str, float]) -> str:
    """The histogram bucket of the slowest pack (GPU time) in a phase."""
    return slowest_ms(before, after, "dq_pack_gpu_seconds")


def stalls(before: dict[str, float], after: dict[str, float], lane: str) -> dict[str, str]:
    """Where a stall of the phase was: the slowest of the lane's waits for a worker and of its states, the slowest
    pack, and the slowest pass of the garbage collector (each as its histogram bucket, ms)."""
    out = {"read": slowest_ms(before, after, "dq_queue_wait_seconds", lane=lane)}
    for state in STATES:
        out[state] = slowest_ms(before, after, "dq_request_state_seconds", lane=lane, state=state)
    out["pack"] = slowest_pack_ms(before, after)
    out["gc"] = slowest_ms(before, after, "dq_gc_pause_seconds")
    return out


def redis_fsync_stalls(url: str) -> int:
    """Writes Redis delayed because the AOF's fsync of the second before had not finished (a slow disk)."""
    import redis

    return int(redis.Redis.from_url(url).info("persistence").get("aof_delayed_fsync", 0))
