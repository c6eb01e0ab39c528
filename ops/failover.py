"""Failover: what a Redis failover under load costs the queue, counted in the style of Jepsen.

A primary, a replica and three sentinels on loopback (the server binary in sentinel mode), two CPU worker processes
and producer threads that submit requests with ids and read their results, all through a ``redis+sentinel://``
URL; the primary is made to fail under load, again and again: killed (-9) and restarted, frozen (SIGSTOP) for
longer than the sentinels' down-after time and let go, or handed over (``SENTINEL FAILOVER``). Each time the
replica is promoted and the old primary comes back as its replica. Then a checker counts, from the final primary:

- ``lost``: requests whose enqueue was acknowledged to the producer that never got a result;
- ``read_lost``: results a producer read that later vanished or were replaced (published again);
- ``changed``: of those, results whose answer changed (another probability), and ids answered twice differently;
- ``pending``: entries left in the work streams or pending in the group once the load stopped;
- ``workers``: workers that exited or were not ready again at the end (wedged).

    python ops/failover.py --failovers 20 --wait-replicas 0 1 --out failover.md    # every kind, both modes
    python ops/failover.py --cluster --failovers 20 --wait-replicas 0 1             # Redis Cluster, kill -9
    python ops/failover.py --cluster --kinds unsynced --failovers 5                 # killed during a resync
    python ops/failover.py --cluster --kinds migrate --failovers 10                 # shard 0's slot moved and back

``--cluster``: a Redis Cluster of three primaries with a replica each instead, the primary of shard 0's work
streams killed (-9) with its replica in sync (``kill``), or during the replica's first sync (``unsynced``); or
nothing killed, shard 0's slot moved to another primary and back as ``redis-cli --cluster reshard`` moves it
(``migrate``; the checker also counts valid requests answered with an error, ``answered_error``). With
``--kinds none`` (and in every full run) a run without failures measures what durability costs: throughput,
enqueue and end-to-end p50/p99 with N = 0 against N = 1, and the Redis commands per request (INFO commandstats,
summed over a cluster's primaries); ``--cost`` measures only that, N = 0 and N = 1 in turn on one server set.
tests/redis/test_failover.py runs a short version of the same code on each server. What fails is
ops/failover_deployments.py's (Sentinel) and ops/failover_cluster.py's; the producers and the checker are
ops/failover_load.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from ops.failover_cluster import Clustered  # noqa: E402
from ops.failover_deployments import KINDS, Replicated, Worker  # noqa: E402
from ops.failover_load import COUNTED, Run, check, commandstats, produce  # noqa: E402
from producer.local.binaries import Binary, find, probe  # noqa: E402
from producer.wire.library import REVISION_FUNCTION  # noqa: E402

WORKER_FLAGS = {"claim_idle_ms": 2000, "read_count": 16, "max_inflight": 64, "max_deliveries": 50,
                "max_wait_ms": 2}


def one_run(cluster: Replicated | Clustered, workers: list[Worker], kind: str, wait_replicas: int, failovers: int,
            producers: int = 4, batch: int = 5, gap_s: float = 1.5, duration_s: float = 20.0,
            drain_s: float = 60.0) -> Run:
    """Load, ``failovers`` failures of ``kind`` (``mixed``: each of the topology's kinds in turn; ``none``:
    ``duration_s`` of load without), then the checker."""
    run, stop, lock = Run(kind, wait_replicas, cluster.cluster), threading.Event(), threading.Lock()
    prefix = f"{kind}-{wait_replicas}-{time.time_ns()}"
    before = commandstats(cluster.client()) if kind == "none" else {}
    threads = [threading.Thread(target=produce, args=(cluster.url, run, f"{prefix}-{p}", stop, lock, batch),
                                daemon=True) for p in range(producers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    if kind == "none":
        time.sleep(duration_s)
    for number in range(failovers if kind != "none" else 0):
        time.sleep(gap_s)
        run.failovers.append(cluster.fail(cluster.KINDS[number % len(cluster.KINDS)] if kind == "mixed" else kind))
    time.sleep(gap_s)
    stop.set()
    for thread in threads:
        thread.join(60)
    run.seconds = time.monotonic() - started
    primary = cluster.client()
    check(primary, run, drain_s)
    revisions = primary.execute_command("FCALL", REVISION_FUNCTION, 0, **(
        {"target_nodes": redis.RedisCluster.PRIMARIES} if cluster.cluster else {}))
    run.library = min(map(int, revisions.values())) if isinstance(revisions, dict) else int(revisions)
    if before:
        after = commandstats(primary)
        run.commands = {name: round((after.get(name, 0) - before.get(name, 0)) / max(1, len(run.read)), 2)
                        for name in sorted(after) if after.get(name, 0) - before.get(name, 0) > 0
                        and not name.startswith(("info", "ping", "role", "replconf", "hello", "client", "xinfo",
                                                 "publish|", "subscribe", "sentinel"))}
    run.workers_down = sum(1 for w in workers if w.process.poll() is not None or not w.wait_ready(30))
    return run


def cost(checkpoint: Path, binary: Binary | None = None, rounds: int = 3, phase_s: float = 15.0,
         logs: Path | None = None, clustered: bool = False) -> list[Run]:
    """What durability costs, in one run: one server set (Sentinel's, or a Redis Cluster), two workers with
    ``--wait-replicas 0`` and two with 1, each pair on a namespace of its own, loaded in turn (``rounds`` phases of
    ``phase_s`` seconds each, N = 0 then N = 1), no failures. Returns one Run per N, the phases' figures together
    (Redis calls summed over a cluster's primaries)."""
    logs = logs or Path(tempfile.mkdtemp(prefix="dq-failover-"))
    cluster = (Clustered if clustered else Replicated)(binary).start()
    extra = {"redis_cluster": True} if clustered else {}
    workers = [Worker(checkpoint, cluster.url, logs / f"cost-{n}-{i}.log", wait_replicas=n, namespace=f"n{n}",
                      **extra, **WORKER_FLAGS) for n in (0, 1) for i in range(2)]
    runs = {n: Run("none", n, cluster.cluster, namespace=f"n{n}") for n in (0, 1)}
    try:
        if not all(w.wait_ready() for w in workers):
            raise RuntimeError(f"a worker did not start: see {logs}")
        for round_ in range(rounds):
            for n, run in runs.items():
                stop, lock = threading.Event(), threading.Lock()
                threads = [threading.Thread(target=produce, args=(cluster.url, run, f"c{round_}-{n}-{p}", stop, lock,
                                                                  5), daemon=True) for p in range(4)]
                started, before = time.monotonic(), commandstats(cluster.client())
                for thread in threads:
                    thread.start()
                time.sleep(phase_s)
                stop.set()
                for thread in threads:
                    thread.join(60)
                run.seconds += time.monotonic() - started
                after = commandstats(cluster.client())
                for name in COUNTED:  # the other pair idles meanwhile: its few calls are counted here too
                    run.commands[name] = run.commands.get(name, 0) + after.get(name, 0) - before.get(name, 0)
        for run in runs.values():
            check(cluster.client(), run, 60.0)
            run.commands = {name: round(calls / max(1, len(run.acked)), 2) for name, calls in run.commands.items()}
    finally:
        for worker in workers:
            worker.stop()
        cluster.close()
    return list(runs.values())


def session(checkpoint: Path, plans: list[tuple[str, int, int]], binary: Binary | None = None,
            logs: Path | None = None, clustered: bool = False, **run_options: object) -> list[Run]:
    """Servers, sentinels and two workers per durability setting; each plan (kind, wait_replicas, failovers) run
    in turn."""
    runs = []
    logs = logs or Path(tempfile.mkdtemp(prefix="dq-failover-"))
    for wait_replicas in sorted({n for _, n, _ in plans}):
        cluster = (Clustered if clustered else Replicated)(binary).launch()
        extra = {"redis_cluster": True} if clustered else {}
        # started before the servers settle: each loads its model meanwhile (a few seconds of each run)
        workers = [Worker(checkpoint, cluster.url, logs / f"worker-{wait_replicas}-{i}.log", **extra,
                          wait_replicas=wait_replicas, **WORKER_FLAGS) for i in range(2)]
        try:
            cluster.settle()
            if not all(w.wait_ready() for w in workers):
                raise RuntimeError(f"a worker did not start: see {logs}")
            for kind, n, failovers in plans:
                if n == wait_replicas:
                    runs.append(one_run(cluster, workers, kind, n, failovers, **run_options))  # type: ignore[arg-type]
                    print(json.dumps(runs[-1].row()), flush=True)
        finally:
            for worker in workers:
                worker.stop()
            cluster.close()
    return runs


def table(runs: list[Run], server: str) -> str:
    columns = ["kind", "wait_replicas", "failovers", "acked", "lost", "read", "read_lost", "changed", "pending",
               "answered_error", "workers_down", "not_durable", "per_s", "enqueue_p50_ms", "enqueue_p99_ms", "e2e_p50_ms",
               "e2e_p99_ms"]
    lines = [f"{server}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        row = run.row()
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    for run in runs:
        if run.commands:
            lines.append(f"\ncommands per request read, wait_replicas={run.wait_replicas}: {json.dumps(run.commands)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="redis-server or valkey-server binary (default: producer/local/binaries.py's)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: a tiny random one, written here)")
    parser.add_argument("--failovers", type=int, default=20, help="failures of each kind per run [20]")
    parser.add_argument("--kinds", nargs="+", choices=["none", "mixed", *KINDS, *Clustered.KINDS],
                        help="failures (Sentinel: none kill stop planned, the default; Cluster: kill, the default, "
                             "unsynced and migrate)")
    parser.add_argument("--wait-replicas", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the run without failures [30]")
    parser.add_argument("--out", help="append the table (Markdown) to this file")
    parser.add_argument("--cost", action="store_true",
                        help="only what durability costs: N = 0 and N = 1 in turn on one server set, no failures")
    parser.add_argument("--cluster", action="store_true",
                        help="Redis Cluster (3 primaries, a replica each) instead of Sentinel")
    args = parser.parse_args(argv)
    binary = probe(args.server) if args.server else None
    checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="dq-tiny-")) / "tiny"
    if not args.checkpoint:
        subprocess.run([sys.executable, "-m", "worker", "tiny-checkpoint", str(checkpoint)], cwd=ROOT, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    kinds = args.kinds or (["kill"] if args.cluster else ["none", *KINDS])
    if not set(kinds) <= {"none", "mixed", *(Clustered if args.cluster else Replicated).KINDS}:
        parser.error(f"--kinds {' '.join(kinds)}: not failures of {'Cluster' if args.cluster else 'Sentinel'}")
    plans = [(kind, n, args.failovers) for n in args.wait_replicas for kind in kinds]
    runs = cost(checkpoint, binary, clustered=args.cluster) if args.cost else session(
        checkpoint, plans, binary, clustered=args.cluster, duration_s=args.duration)
    text = table(runs, f"{(binary or find()).label}{', Redis Cluster' if args.cluster else ', Sentinel'}, "
                       f"{time.strftime('%Y-%m-%d')}, `python ops/failover.py {' '.join(sys.argv[1:])}`")
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(text + "\n")
    durable = [r for r in runs if r.wait_replicas > 0]
    return 1 if any(r.lost or r.read_lost or r.changed or r.pending or r.workers_down or r.answered_error
                    for r in durable) else 0


if __name__ == "__main__":
    sys.exit(main())
