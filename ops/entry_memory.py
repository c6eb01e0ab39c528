"""A worker's memory against huge entries: a local server, a CPU worker process on the tiny checkpoint, then
``--entries`` entries of ``--mb`` MB each in one burst (each over ``--max-entry-bytes``, so refused unparsed); prints
the worker's resident memory when ready, its peak while they are refused, and after (docs/RELIABILITY.md, fault 15).

    python ops/entry_memory.py --entries 8 --mb 100
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops/bench")]

import redis  # noqa: E402

from producer.local.server import RedisServer  # noqa: E402
from producer.wire.keys import Keys  # noqa: E402
from tiny_worker import tiny_worker  # noqa: E402


def resident_mb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=8)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--watch-s", type=float, default=15.0, help="how long to watch after the burst")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dq-memory-"))
    with RedisServer("--appendonly", "no") as server, tiny_worker(work, server.url) as worker:
        time.sleep(3)
        ready = resident_mb(worker.pid)
        client, stream = redis.Redis.from_url(server.url), Keys().requests
        pad = "x" * (args.mb << 20)
        with client.pipeline(transaction=True) as pipe:  # one burst: they wake the idle worker together
            for n in range(args.entries):
                pipe.xadd(stream, {"body": json.dumps({"id": f"huge-{n}", "state": pad})})
            pipe.execute()
        peak, start = ready, time.monotonic()
        while time.monotonic() - start < args.watch_s:
            peak = max(peak, resident_mb(worker.pid))
            time.sleep(0.1)
        print(f"{args.entries} entries of {args.mb} MB: worker resident {ready} MB ready, peak {peak} MB "
              f"(+{peak - ready}), after {resident_mb(worker.pid)} MB (+{resident_mb(worker.pid) - ready}); "
              f"left in the stream: {client.xlen(stream)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
