"""A pack launch's host time against the GIL's switch interval, on the CPU: a model of the GPU thread's launch
beside the worker's other threads.

    python ops/bench/gil_launch.py                       # intervals 5, 0.5, 0.1 and 0.05 ms; shares 0, 0.25, 0.4

A launch gives the GIL up at each CUDA graph replay and kernel launch (about a hundred times per pack at the 2B shape:
a graph per layer and the mixers' kernels between them) and takes it back behind whichever thread holds it, for
up to the switch interval when that thread runs Python (worker/gpu/compute.py). Here the "launch" is 120 calls
that give the GIL up (hashing ``--release-kib``: a graph replay's or kernel launch's time in the driver) with
20 us of Python after each, and the
other thread holds the GIL for ``share`` of every 90 ms (one 2B pack) in 1 ms pieces, as the Redis loop and the
planners' result thread do per request (``ops/bench/host_ceiling.py``: about 0.76 ms per request, a quarter to
two fifths of the GIL at the peak, by host). Prints the launch's mean, p90 and max per interval and share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time



def python_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(40))


def launch(releases: int, block: bytes) -> float:
    began = time.perf_counter()
    for _ in range(releases):
        hashlib.sha256(block).digest()  # hashlib gives the GIL up for data of 2 KiB or more
        python_for(20e-6)
    return time.perf_counter() - began


def measure(interval: float, share: float, releases: int, launches: int, block: bytes) -> dict:
    sys.setswitchinterval(interval)
    stop = threading.Event()

    def other() -> None:  # per 90 ms, share of it in Python, in 1 ms requests
        while not stop.is_set():
            began = time.perf_counter()
            for _ in range(round(share * 90)):
                python_for(0.001)
            stop.wait(max(0.0, 0.09 - (time.perf_counter() - began)))

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    seconds = []
    for _ in range(launches):
        seconds.append(launch(releases, block) * 1000)
        time.sleep(0.03)  # the launch starts at a different point of the other thread's work each time
    stop.set()
    thread.join()
    seconds.sort()
    return {"interval_ms": interval * 1000, "share": share, "mean_ms": round(statistics.mean(seconds), 2),
            "p90_ms": round(seconds[int(0.9 * len(seconds))], 2), "max_ms": round(seconds[-1], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", default="5,0.5,0.1,0.05")
    parser.add_argument("--shares", default="0,0.25,0.4")
    parser.add_argument("--releases", type=int, default=120)
    parser.add_argument("--launches", type=int, default=60)
    parser.add_argument("--release-kib", type=int, default=16,
                        help="KiB hashed per release (16: about 9 us on the CPU machine; 64: about 33)")
    args = parser.parse_args()
    default = sys.getswitchinterval()
    rows = []
    for share in (float(each) for each in args.shares.split(",")):
        for interval in (float(each) / 1000 for each in args.intervals_ms.split(",")):
            rows.append(measure(interval, share, args.releases, args.launches, b"x" * (1024 * args.release_kib)))
            print(json.dumps(rows[-1]), flush=True)
    sys.setswitchinterval(default)
    print("SUMMARY " + json.dumps(rows))


if __name__ == "__main__":
    main()
