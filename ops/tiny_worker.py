"""A worker process on the tiny checkpoint, on the CPU, against a given server: what the ops scripts that measure a
worker's behaviour (entry_memory.py, long_state.py) run it as. Its log is ``work/worker.log``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops/bench")]

from served import wait_ready  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from worker.model import tiny  # noqa: E402


@contextlib.contextmanager
def tiny_worker(work: Path, redis_url: str) -> Iterator[subprocess.Popen]:
    """The worker process, once ready (SystemExit with its log's tail if it is not within 120 s); stopped on
    leaving."""
    port, log = free_port(), work / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--checkpoint", str(tiny.write(work / "tiny")), "--redis-url",
             redis_url, "--metrics-port", str(port), "--device", "cpu"], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait_ready(worker, port, 120, log)
        yield worker
    finally:
        worker.terminate()
        worker.wait(30)
