"""A worker's time against over-long states: a local server, a CPU worker process on the tiny checkpoint (4,096 tokens
a prompt), then for each kind of state (text, an array of numbers, an object of many keys) one request of ``--mb``
MB, with small requests sent one after another behind it; prints how long the long one took to be answered
(``state_too_long``) and what the small ones waited meanwhile (docs/RELIABILITY.md, "Hostile callers").

    python ops/long_state.py --mb 4.7
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops/bench")]

from producer.client import Client  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402
from tiny_worker import tiny_worker  # noqa: E402

QUESTIONS = {"refund": {"type": "noul"}, "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}


def states(size: int) -> dict[str, object]:
    """Each kind of state, about ``size`` bytes of JSON."""
    return {"text": "refund please " * (size // 14), "numbers": list(range(size // 8)),
            "keys": {f"k{i}": None for i in range(size // 12)}}


def small(client: Client, prefix: str, stop: threading.Event, waits: list[float]) -> None:
    """Small requests one after another until ``stop``; each one's time to its result."""
    number = 0
    while not stop.is_set():
        start = time.monotonic()
        [request_id] = client.submit_many([{"id": f"{prefix}-{number}", "state": "Charged twice.",
                                            "questions": QUESTIONS}])
        client.wait_many([request_id], timeout=120)
        waits.append(time.monotonic() - start)
        number += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=4.7, help="each long state's size [4.7]")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dq-long-state-"))
    with RedisServer("--appendonly", "no") as server, tiny_worker(work, server.url):
        client = Client(server.url)
        alone: list[float] = []
        for n in range(20):  # small requests alone first
            start = time.monotonic()
            client.wait_many(client.submit_many([{"id": f"alone-{n}", "state": "Charged twice.",
                                                  "questions": QUESTIONS}]), timeout=60)
            alone.append(time.monotonic() - start)
        print(f"small requests alone: p50 {sorted(alone)[10] * 1000:.0f} ms, max {max(alone) * 1000:.0f} ms")
        for kind, state in states(int(args.mb * 1e6)).items():
            stop, waits = threading.Event(), []
            beside = threading.Thread(target=small, args=(Client(server.url), kind, stop, waits), daemon=True)
            start = time.monotonic()
            [long_id] = client.submit_many([{"id": f"long-{kind}", "state": state, "questions": QUESTIONS}])
            beside.start()
            result = client.wait_many([long_id], timeout=600)[long_id]
            took = time.monotonic() - start
            stop.set()
            beside.join(120)
            code = result.error.code.value if result.error else result.status
            print(f"{kind}: {len(json.dumps(state)) / 1e6:.1f} MB answered {code} in {took:.2f} s; "
                  f"{len(waits)} small requests meanwhile, slowest {max(waits, default=0) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
