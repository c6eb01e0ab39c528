"""dq-gateway (or python -m producer.gateway): the queue behind an HTTP endpoint.

  dq-gateway --redis-url redis://127.0.0.1:6379/0                      open, on 127.0.0.1:8080 only
  dq-gateway --host 0.0.0.0 --api-keys-file keys.json                  API keys: any address
  dq-gateway --model-namespaces dq,dq-b --model-alias jev-latest=my-decider     System One calls, routed by model

It takes the producer's connection flags and variables (--redis-url or DQ_REDIS_URL, --namespace, --shards,
TLS, Redis Cluster) and its own (--host, --port, limits; DQ_GATEWAY_*). Exit codes: 0 stopped, 2 usage (a bad
flag, variable or keys file, or a --model-alias that names a model live workers serve: before it listens; or
the http extra not installed), 4 Redis unreachable at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time

from .. import __version__
from ..plumbing.connection import Deployment, check_reachable, connect
from ..plumbing.exits import FAILED, OK, UNREACHABLE, USAGE
from ..plumbing.extras import needed
from ..wire.keys import PROTOCOL, Keys
from .config import ConfigError, GatewayConfig, add_arguments, load
from .front import logs

log = logging.getLogger("producer.gateway")
SHUTDOWN_GRACE_S = 5  # past --max-wait-s, a call still running at a stop is cut
FILES_BESIDE = 64  # file descriptors besides connections and the Redis pool: the listener, readiness, logs, ...


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dq-gateway", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version",
                     version=f"dq-gateway {__version__} (decision-queue, wire protocol v{PROTOCOL})")
    defaults = Deployment()
    for name, (flags, metavar, text) in Deployment.FLAGS.items():
        default, env = getattr(defaults, name), Deployment.ENV[name]
        kind: dict = ({"action": "store_true"} if isinstance(default, bool)
                      else {"type": int, "metavar": metavar} if isinstance(default, int) else {"metavar": metavar})
        shown = ("on" if default else "off") if isinstance(default, bool) else repr(default)
        top.add_argument(*flags, dest=name, default=None, help=f"{text} [env {env}, default {shown}]", **kind)
    add_arguments(top)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # --help and --version: no extra needed
    with needed("http", "dq-gateway"):  # else: which extra to install, exit 2
        import uvicorn  # noqa: F401

        from . import routes  # noqa: F401
    try:
        config = load(vars(args))
    except (ConfigError, ValueError) as error:
        print(f"dq-gateway: {error}", file=sys.stderr)
        return USAGE
    logs.setup(config)  # one format for every line: the gateway's and uvicorn's
    try:  # a wrong URL or password is said at once, not as a 503 on every call
        check_reachable(config.deployment)
    except Exception as error:  # noqa: BLE001 - redis errors and a TLS file that cannot be read alike
        print(f"dq-gateway: Redis at {config.deployment.safe_url}: {error}", file=sys.stderr)
        return UNREACHABLE
    if shadowed := shadowing_aliases(config):
        print(f"dq-gateway: --model-alias (DQ_GATEWAY_MODEL_ALIAS) names a model live workers serve, and an "
              f"alias never shadows a served name: {'; '.join(shadowed)}", file=sys.stderr)
        return USAGE
    return serve(config)


def shadowing_aliases(config: GatewayConfig) -> list[str]:
    """The aliases that name a model the live workers of the gateway's namespaces serve now (read once, at
    start; one that a worker serves later is logged and not routed by: systemone/models.py)."""
    if not config.aliases:
        return []
    import redis

    from .systemone.models import shadowing

    client = connect(config.deployment.url, config.deployment.cluster, **config.deployment.options())
    try:
        beats = {namespace: client.hgetall(Keys(namespace).workers()) for namespace in config.namespaces()}
    except redis.RedisError:  # a user that may not read heartbeats: routing says so on each call
        return []
    finally:
        client.close()
    return shadowing(config.aliases, beats, time.time())


def serve(config: GatewayConfig) -> int:
    """Serve until SIGTERM or SIGINT: new connections stop, calls in progress finish (at most ``--max-wait-s``
    and a little), then exit 0."""
    import uvicorn

    from ..plumbing import traces
    from .routes import create_app

    config = fit_file_limit(config)
    if not config.keys:
        log.warning("no API keys: anyone who can reach %s:%d may use the queue (namespace %s); listening on a "
                    "loopback address only", config.host, config.port, config.deployment.namespace)
    else:
        log.info("%d API keys; namespaces %s", len(config.keys), ", ".join(config.namespaces()))
    traces.configure("dq-gateway")  # on when an OTLP endpoint is set (OTEL_EXPORTER_OTLP_*)
    log.info("dq-gateway %s (wire protocol v%s) on %s:%d", __version__, PROTOCOL, config.host, config.port)
    front = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        logs.cors(front, config), host=config.host, port=config.port, log_config=None,
        log_level=config.log_level.lower(), access_log=False, proxy_headers=False, server_header=False,
        http=front.gateway.connections.protocol(), lifespan="on", timeout_keep_alive=config.keep_alive_s,
        timeout_graceful_shutdown=int(config.max_wait_s) + SHUTDOWN_GRACE_S))
    # uvicorn stops gracefully on SIGTERM and SIGINT, then puts back the handlers it found and signals itself
    # again: with Python's default ones the process then died by the signal (143), not the documented 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    server.run()
    traces.shutdown()
    return OK if server.started else FAILED


def fit_file_limit(config: GatewayConfig) -> GatewayConfig:
    """``--max-connections`` under the process's open-file limit, with room for the Redis pool and the rest:
    the soft limit is raised to what is needed (up to the hard one); where even that is too low, the cap is
    lowered and said. At the limit the gateway could accept nobody, and said nothing."""
    import resource

    from .service import pool_size

    others = pool_size(config) + FILES_BESIDE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = config.max_connections + others
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fits = max(1, soft - others)
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d (hard), and the Redis pool and "
                    "the rest need %d", config.max_connections, fits, soft, others)
        return dataclasses.replace(config, max_connections=fits)
    return config


if __name__ == "__main__":
    sys.exit(main())
