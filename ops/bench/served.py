"""The benchmarks' worker: the real daemon around a random model at a real Qwen3.5 shape (or the tiny checkpoint on
the CPU), run as a process of its own (``--worker``) with the flags every benchmark shares, and started, waited for
and stopped by the benchmark (end_to_end.py, priority.py, invariance.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker.config import Settings  # noqa: E402


DEFAULTS = Settings()  # the worker's own defaults


def model_for(shape: str):
    """A random model at ``shape`` that renders requests with the tiny checkpoint's tokenizer and template;
    ``tiny``: the tiny checkpoint itself, on the CPU (checks this harness without a GPU)."""
    import tempfile

    from worker.model import checkpoint, tiny

    if shape == "tiny":
        return checkpoint.load(tiny.write(tempfile.mkdtemp(), multimodal=False), device="cpu")
    from synthetic import random_model

    return random_model(shape, rendering=tiny.rendering())


def settings_for(args: argparse.Namespace, **extra):
    gpu = args.shape != "tiny"
    return Settings(checkpoint="(random)", device="cuda" if gpu else "cpu", engine="fast" if gpu else "reference",
                    fp8=args.fp8, fp8_layers=args.fp8_layers, compile=args.compile, compile_cache=args.compile_cache,
                    cuda_graphs=not args.no_graphs, buckets=args.buckets, planner_processes=args.planner_processes,
                    max_inflight=args.max_inflight, deterministic=args.deterministic, read_count=128,
                    claim_idle_ms=600_000, epilogues=args.epilogues,
                    **({} if args.max_wait_ms is None else {"max_wait_ms": args.max_wait_ms}), **extra)


def serve_worker(args: argparse.Namespace, make_model: Callable[[], Any] | None = None,
                 after_warmup: Callable[[Any], None] | None = None, **extra: Any) -> int:
    """A benchmark's worker process (``--worker``): the real daemon around ``make_model()`` (default: the random
    model of ``--shape``), with the benchmarks' settings and ``extra``, its metrics and health on
    ``--metrics-port``; ``after_warmup(daemon)`` runs before it reports ready."""
    from worker.daemon import Daemon
    from worker.health import serve_http
    from worker.logs import setup_logging

    setup_logging("text", "INFO")
    # Asked for, or the worker's default (on where its kernels run: the Hopper cards these run on; pass
    # --no-deterministic elsewhere): cuBLAS's settings precede the first GPU matmul, the random model's making
    # included.
    if args.deterministic is not False:
        from worker.fast import deterministic

        deterministic.prepare_process()
    daemon = Daemon(settings_for(args, redis_url=args.redis_url, metrics_port=args.metrics_port, **extra),
                    model=make_model() if make_model is not None else model_for(args.shape))
    serve_http(daemon, args.metrics_port)
    return daemon.run(after_warmup=(lambda: after_warmup(daemon)) if after_warmup else None)


def wait_ready(worker: subprocess.Popen, port: int, timeout: float, log_path: Path) -> float:
    """Seconds until the benchmark's worker answers /readyz with 200; SystemExit, with its log's tail, if it exits
    or takes longer than ``timeout``."""
    started = time.monotonic()
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                return round(time.monotonic() - started, 1)
        except OSError:
            pass
        if worker.poll() is not None or time.monotonic() - started > timeout:
            print(log_path.read_text()[-4000:])
            raise SystemExit("the worker did not become ready")
        time.sleep(0.5)


def deterministic_of(port: int) -> bool | None:
    """Whether the benchmark's worker runs deterministic mode, as it decided at start (its ``dq_build_info``);
    None if its metrics do not say."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'^dq_build_info\{[^}]*deterministic="(true|false)"', text, re.MULTILINE)
    return None if found is None else found.group(1) == "true"


@contextlib.contextmanager
def worker_process(script: str, args: argparse.Namespace, url: str, log_path: Path,
                   *extra: str) -> Iterator[tuple[int, float]]:
    """A benchmark's worker process (``script --worker`` with the shared worker flags, then ``extra``), its output
    in ``log_path``: yields its metrics port and its seconds to ready; stopped on leaving."""
    from producer.local.ports import free_port

    port = free_port()
    cmd = [sys.executable, script, "--worker", "--shape", args.shape, "--redis-url", url, "--metrics-port", str(port),
           "--compile", args.compile, "--buckets", args.buckets, "--planner-processes", str(args.planner_processes),
           "--max-inflight", str(args.max_inflight)]
    cmd += ["--fp8", "--fp8-layers", args.fp8_layers] if args.fp8 else []
    cmd += ["--compile-cache", args.compile_cache] if args.compile_cache else []
    cmd += ["--no-graphs"] if args.no_graphs else []
    cmd += {True: ["--deterministic"], False: ["--no-deterministic"], None: []}[args.deterministic]
    cmd += ["--epilogues", args.epilogues] if args.epilogues else []
    cmd += ["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms is not None else []
    with open(log_path, "w") as log:
        worker = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            ready = wait_ready(worker, port, args.start_timeout, log_path)
            print(f"worker ready in {ready} s", flush=True)
            yield port, ready
        finally:
            worker.terminate()
            worker.wait(120)


def worker_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmark's worker process, shared with priority.py."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="2b", choices=("0.8b", "2b", "4b", "tiny"),
                        help="tiny: the tiny checkpoint on the CPU (checks this harness without a GPU)")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--fp8-layers", default="all", help="the worker's --fp8-layers (with --fp8)")
    parser.add_argument("--compile", default="layer", choices=("none", "sub", "layer"))
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="the worker's --deterministic or --no-deterministic (default: its own, on where its "
                             "kernels run)")
    parser.add_argument("--epilogues", default=DEFAULTS.epilogues,
                        help="the worker's --epilogues (worker/fast/epilogues.py; default: its own)")
    parser.add_argument("--compile-cache", default="", help="the worker's compile_cache (empty: the defaults)")
    parser.add_argument("--buckets", default=DEFAULTS.buckets, help="the worker's --buckets")
    parser.add_argument("--max-wait-ms", type=float, default=None, help="the worker's --max-wait-ms (default: its own)")
    parser.add_argument("--planner-processes", type=int, default=4)
    parser.add_argument("--max-inflight", type=int, default=1024)
    parser.add_argument("--start-timeout", type=float, default=400.0)
