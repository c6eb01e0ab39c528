"""dq-worker (or python -m worker): serve, write a tiny checkpoint, check a running worker's health, or load
the queue's function library onto a Redis server."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from producer import __version__
from producer.plumbing.connection import WAIT_MS, Deployment
from producer.plumbing.extras import needed, require
from producer.plumbing.supported import UnsupportedServer
from producer.wire.keys import PROTOCOL

from .config import Settings

log = logging.getLogger("worker")
# sysexits' EX_TEMPFAIL: the metrics port is held, maybe by a process on its way out; try again
PORT_IN_USE = 75


def _tiny(args: argparse.Namespace) -> int:
    with needed("worker", "dq-worker tiny-checkpoint"):
        from .model import tiny

    path = tiny.write(args.directory, seed=args.seed, fmt=args.format, multimodal=not args.text_only)
    print(f"wrote a tiny {args.format} decision checkpoint to {path}")
    return 0


def _load_functions(args: argparse.Namespace) -> int:
    import redis

    from producer.plumbing import library_loader
    from producer.wire import library
    from producer.plumbing.connection import Deployment, connect
    from producer.plumbing.supported import UnsupportedServer, check

    try:
        deployment = Deployment.resolve(**{name: getattr(args, name) for name in Deployment.FLAGS})
    except ValueError as error:
        print(f"dq-worker load-functions: error: {error}", file=sys.stderr)
        return 2
    try:
        client = connect(deployment.url, deployment.cluster, **deployment.options())
        try:
            check(client, deployment.safe_url)
            loaded = library_loader.ensure(client)
            created = _create_groups(client, deployment)
            short = _short_of_replicas(client, deployment) if deployment.wait_replicas else []
        finally:
            client.close()
    except (library.LibraryUnavailable, UnsupportedServer, redis.RedisError) as error:
        print(f"dq-worker load-functions: {deployment.safe_url}: {error}", file=sys.stderr)
        return 1
    print(f"{library.LIBRARY} revision {loaded.revision} {loaded.action} on {deployment.safe_url}; "
          f"{created} of {4 * deployment.shards} work streams' consumer group created (the rest were there)"
          + (f"; {deployment.wait_replicas} replicas of every primary have both" if deployment.wait_replicas
             and not short else ""))
    if short:
        print(f"dq-worker load-functions: {deployment.safe_url}: loaded, but fewer than "
              f"{deployment.wait_replicas} replicas confirmed within {WAIT_MS} ms on {', '.join(short)}",
              file=sys.stderr)
    return 1 if short else 0


def _short_of_replicas(client: Any, deployment: Deployment) -> list[str]:
    """``--wait-replicas N``: on each primary, a write after the library and the groups (a mark that lives 10
    s), then a WAIT on the same connection: a replica that confirms it has everything the primary had before
    it. (A WAIT alone proves nothing where nothing was written: the library was there already.) The primaries
    that fell short, each with its count; a refusal is raised."""
    import redis

    from producer.plumbing.cluster_wait import MARK_TTL_MS
    from producer.plumbing.commands import command
    from producer.plumbing.durable import Durable, run
    from producer.wire.keys import Keys

    keys, wanted = Keys(deployment.namespace), deployment.wait_replicas
    marks: dict[str, str] = {}  # a key in a slot of each primary
    if not isinstance(client, redis.RedisCluster):
        marks["the primary"] = keys.durable_mark("load")
    for number in range(100_000 if not marks else 0):
        key = keys.durable_mark(f"load-{number}")
        marks.setdefault(client.get_node_from_key(key).name, key)
        if len(marks) == len(client.get_primaries()):
            break
    sent = run(client, Durable([command("SET", key, "", "PX", MARK_TTL_MS) for key in marks.values()], wanted))
    for reply in sent.replies:
        if isinstance(reply, BaseException):
            raise reply
    return [f"{node} ({count})" for node, count in zip(marks, sent.replicas) if count < wanted]


def _create_groups(client: Any, deployment: Any) -> int:
    """Every shard's work streams and the workers' group, made before any worker runs: an autoscaler that
    polls a stream or group that does not exist errors or, in some KEDA releases, scales without bound
    (keda#7447). Workers create the same at start (from id 0: nothing already queued is skipped)."""
    import redis

    from producer.wire.keys import LANES, Keys

    created = 0
    for shard in range(deployment.shards):
        keys = Keys(deployment.namespace, shard)
        for stream in [name for lane in LANES for name in (keys.requests_in(lane), keys.parts_in(lane))]:
            try:
                client.xgroup_create(stream, keys.group, id="0", mkstream=True)
                created += 1
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
    return created


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dq-worker", description=__doc__)
    top.add_argument("--version", action="version",
                     version=f"dq-worker {__version__} (decision-queue, wire protocol v{PROTOCOL})")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny_cmd = commands.add_parser("tiny-checkpoint", help="write a tiny random Qwen3.5 decision checkpoint")
    tiny_cmd.add_argument("directory", help="where to write it (created if missing)")
    tiny_cmd.add_argument("--seed", type=int, default=0, help="seed of the random weights [default 0]")
    tiny_cmd.add_argument("--format", choices=("repo", "readout", "judge"), default="repo",
                          help="save_pretrained repo, decision_config.json + readout.safetensors, or JEV "
                               "judge [default 'repo']")
    tiny_cmd.add_argument("--text-only", action="store_true",
                          help="a qwen3_5_text backbone (no vision tower) [default off]")
    tiny_cmd.set_defaults(run=_tiny)

    serve_cmd = commands.add_parser("serve", help="consume requests from Redis and publish results",
                                    usage="dq-worker serve --checkpoint DIR [--redis-url URL] [option ...]",
                                    description="Serve a decision checkpoint from the Redis queue. Every "
                                                "flag is also a DQ_* variable; flags win over variables.")
    Settings.add_arguments(serve_cmd)
    serve_cmd.set_defaults(run=_serve)

    check_cmd = commands.add_parser("check", help="exit 0 if a worker's health endpoint answers 200")
    check_cmd.add_argument("--metrics-port", dest="metrics_port", type=int, default=None,
                           help="the worker's --metrics-port [env DQ_METRICS_PORT, default 0: none served]")
    check_cmd.add_argument("--url", help="the health endpoint's base URL instead (default "
                                         "http://127.0.0.1:PORT)")
    check_cmd.add_argument("--live", action="store_true",
                           help="liveness (/healthz) instead of readiness (/readyz) [default off]")
    check_cmd.set_defaults(run=_check)

    load_cmd = commands.add_parser(
        "load-functions", help="load the function library producers and workers call (an admin's Redis URL)")
    for name, (flags, metavar, text) in Deployment.FLAGS.items():  # the same flags as serve and dq-producer
        text += " (a user that may FUNCTION LOAD: admin)" if name == "url" else ""
        text += ": load on every primary" if name == "cluster" else ""
        if name == "shards":
            text = "stream shards of the deployment: each one's work streams and consumer group are created"
        if name == "wait_replicas":
            text = "exit 1 unless N replicas of every primary confirm the library and the groups (a write, then WAIT)"
        default = repr(getattr(Deployment(), name)) if name != "cluster" else "off"
        env = Deployment.ENV[name]
        kind = ({"action": "store_true"} if name == "cluster" else {"metavar": metavar, "type": int}
                if name in ("shards", "wait_replicas") else {"metavar": metavar})
        load_cmd.add_argument(*flags, dest=name, default=None, help=f"{text} [env {env}, default {default}]", **kind)
    load_cmd.set_defaults(run=_load_functions)
    return top


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser().parse_args(argv)
    return args.run(args)


def _settings(command: str, make: Callable[[], Settings]) -> Settings | None:
    """The settings, or None after printing why they are refused (the caller exits 2, as argparse does)."""
    try:
        return make()
    except ValueError as error:
        print(f"dq-worker {command}: error: {error}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    # before torch is imported or a model loaded
    settings = _settings("serve", lambda: Settings.from_args(args))
    if settings is None:
        return 2
    with needed("worker", "dq-worker serve"):  # torch and the rest: else which extra to install, exit 2
        if settings.gpus:  # one worker process per device, supervised by this one (which imports no torch)
            from .launch import launcher

            require("torch")
        else:
            from . import daemon  # noqa: F401
    if settings.gpus:
        return launcher.serve(settings)
    return serve(settings)


def _check(args: argparse.Namespace) -> int:
    """The same port setting as ``serve``: the same flag, variable and default."""
    with needed("worker", "dq-worker check"):
        from .health import check

    url = args.url
    if url is None:
        settings = _settings("check", lambda: Settings.from_env(metrics_port=args.metrics_port))
        if settings is None:
            return 2
        if not settings.metrics_port:
            print("dq-worker check: error: no health endpoint to ask: --metrics-port (DQ_METRICS_PORT) is 0, "
                  "so serve runs none; set it for both, or pass --url", file=sys.stderr)
            return 2
        host = settings.metrics_host if settings.metrics_host not in ("", "::", "0.0.0.0") else "127.0.0.1"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{settings.metrics_port}"
    return check(url, "/healthz" if args.live else "/readyz")


def serve(settings: Settings) -> int:
    """``dq-worker serve`` without --gpus: this process is the worker. Exit 2 for what no restart can mend."""
    from .daemon import Daemon
    from .logs import setup_logging
    from .loop.redis_calls import first_contact
    from .model import checkpoint

    setup_logging(settings.log_format, settings.log_level)
    if not settings.checkpoint:
        log.error("--checkpoint (DQ_CHECKPOINT) is required")
        return 2
    try:
        settings.redis_options()  # a TLS file with a plain redis:// URL: refuse before loading the model
        first_contact(settings)  # an unsupported server too, when it answers now
        daemon = Daemon(settings)
    except (checkpoint.CheckpointError, ValueError, ImportError, UnsupportedServer) as error:
        log.error("cannot start: %s", error)
        return 2
    except RuntimeError as error:
        if not _refused_here(error):
            raise
        log.error("cannot start: %s", error)
        return 2
    if settings.metrics_port:
        from .health import serve_http

        try:
            serve_http(daemon, settings.metrics_port, settings.metrics_host)
        except OSError as error:
            log.error("cannot serve metrics on port %d: %s", settings.metrics_port, error)
            # In use: a process that holds it may be leaving (an earlier launcher's worker, draining): the
            # launcher starts this one again after a pause. Exit 2 would stop every worker of the host.
            return PORT_IN_USE if error.errno == errno.EADDRINUSE else 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, daemon.on_signal)
    try:
        return daemon.run()
    except RuntimeError as error:  # deterministic mode's check at warm-up
        if not _refused_here(error):
            raise
        log.error("cannot start: %s", error)
        return 2


def _refused_here(error: RuntimeError) -> bool:
    """The fast engine cannot run here, or deterministic mode cannot be kept on this card. Their modules are
    loaded only where the fast engine was tried, so they are looked up rather than imported."""
    refusals = [("errors", "FastPathUnavailable"), ("deterministic", "NotDeterministic")]
    loaded = [(sys.modules.get(f"{__package__}.fast.{module}"), name) for module, name in refusals]
    return any(isinstance(error, getattr(module, name)) for module, name in loaded if module is not None)


if __name__ == "__main__":
    sys.exit(main())
