"""The local stack: a Redis (the embedded Valkey unless a server is installed), a worker on the tiny checkpoint and
the gateway, up until Ctrl-C, for trying the README's snippets (they use these addresses by default).

    bash ops/stack.sh                                  # Redis on 127.0.0.1:6379, the gateway on localhost:8080
    bash ops/stack.sh --redis-port 6380 --gateway-port 8081     # where those are taken
    bash ops/stack.sh --api-keys-file keys.json        # the gateway with API keys (docs/GATEWAY.md)

The gateway serves the model under the System One SDKs' default name too (``--model-alias``, default
``jev-latest``), so a client of that API works with nothing changed but its base URL. The checkpoint has random
weights: its answers are arbitrary; the stack shows the paths (the Python client, the gateway, the System One
API, the protocol, dq-producer), not a model's judgement. Nothing is kept: the data and the checkpoint are in a
temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

UP = "stack: up"  # the line that says every part answers
LAST = "Ctrl-C stops every part and removes what the stack made."  # the end of what it prints once up
REQUEST = '{"state": "I was charged twice.", "questions": {"refund": {"type": "noul"}}}'
DEFAULT_MODEL = "jev-latest"  # the official System One SDKs' default model (typesafe-sdk, @typesafe-ai/sdk)


def taken(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


class Stopped(Exception):
    """Ctrl-C (or SIGTERM) while the stack was starting."""


def wait_for(url: str, process: subprocess.Popen, name: str, log: Path, timeout: float, stop: list[int]) -> None:
    deadline = time.monotonic() + timeout
    while not answers(url):
        if stop:
            raise Stopped()
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            why = f"exited with {process.returncode}" if process.poll() is not None else f"not up in {timeout:g} s"
            raise RuntimeError(f"the {name} {why}; the end of its log ({log}):\n{tail}")
        time.sleep(0.2)


def commands(redis_url: str, gateway: str, default_redis: bool) -> list[str]:
    """The three commands to try, as they run from any shell here."""
    producer = "dq-producer" if shutil.which("dq-producer") else f"{sys.executable} -m producer"
    flag = "" if default_redis else f" --redis-url {redis_url}"
    return [f"curl -s --json '{REQUEST}' {gateway}/v1/decide",
            f"echo '{REQUEST}' | {producer} submit - --wait{flag}",
            f"{producer} stats{flag}"]


def served_names(redis_url: str) -> tuple[str, ...]:
    """The names the live worker serves its model under (its heartbeat's), the one results say first."""
    import redis

    from producer.wire.keys import Keys, beat_models

    with redis.Redis.from_url(redis_url) as connection:
        for beat in connection.hgetall(Keys().workers()).values():
            if beat_models(beat):
                return beat_models(beat)
    raise RuntimeError("the worker is ready but wrote no heartbeat naming its model")


def aliases(asked: list[str], served: str) -> list[str]:
    """``--model-alias`` values as the gateway takes them: ``ALIAS`` names the stack's model, ``ALIAS=NAME``
    another served name."""
    return [alias if "=" in alias else f"{alias}={served}" for alias in asked if alias != served]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/stack.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-port", type=int, default=6379, help="Redis' port on 127.0.0.1 [default 6379]")
    parser.add_argument("--gateway-port", type=int, default=8080, help="the gateway's port [default 8080]")
    parser.add_argument("--checkpoint", default="", help="serve this checkpoint instead of the tiny one")
    parser.add_argument("--model-alias", action="append", metavar="ALIAS[=NAME]",
                        help="another name callers may send for the model (repeat it; '' for none) [default "
                             f"{DEFAULT_MODEL}, the System One SDKs' default model]")
    parser.add_argument("--api-keys-file", default="", metavar="FILE",
                        help="the gateway's API keys (docs/GATEWAY.md); without, it takes any caller on loopback")
    args = parser.parse_args(argv)
    args.model_alias = [a for a in (args.model_alias if args.model_alias is not None else [DEFAULT_MODEL]) if a]
    if args.api_keys_file and not Path(args.api_keys_file).is_file():
        print(f"stack: no API keys file at {args.api_keys_file}", file=sys.stderr)
        return 2
    for port, flag in ((args.redis_port, "--redis-port"), (args.gateway_port, "--gateway-port")):
        if taken(port):
            print(f"stack: port {port} is taken on 127.0.0.1 (a Redis or a gateway already running?): stop it, or "
                  f"give {flag} another port", file=sys.stderr)
            return 2
    stop: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or a kill: the same clean stop
        signal.signal(signum, lambda number, _: stop.append(number))
    work = Path(tempfile.mkdtemp(prefix="dq-stack-"))
    children: dict[str, subprocess.Popen] = {}  # each in a session of its own: Ctrl-C reaches the stack only
    failed = True
    try:
        failed = run(args, work, children, stop)
        return 1 if failed else 0
    except Stopped:
        failed = False
        return 0
    except RuntimeError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    finally:
        for child in children.values():  # the gateway and the worker (it drains), then Redis
            if child.poll() is None:
                child.terminate()
        for child in children.values():
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
        if failed:
            print(f"stack: its logs are kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, children: dict[str, subprocess.Popen], stop: list[int]) -> bool:
    """Start every part, say what to try, wait for a stop; True when a part failed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    checkpoint = args.checkpoint
    if not checkpoint:
        print("stack: a tiny checkpoint with RANDOM weights serves the requests: its answers are arbitrary (it shows "
              "the paths, not a model's judgement)", flush=True)
        checkpoint = str(work / "tiny-checkpoint")
        made = subprocess.run([sys.executable, "-m", "worker", "tiny-checkpoint", checkpoint], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"the tiny checkpoint could not be written:\n{made.stderr[-3000:]}")
    (work / "redis").mkdir()
    with RedisServer(port=args.redis_port, appendonly=False, directory=str(work / "redis"), detached=True) as server:
        where = "embedded" if server.found.embedded else server.binary
        metrics = free_port()
        gateway = f"http://localhost:{args.gateway_port}"
        print(f"stack: {server.server} ({where}) on {server.url}; starting a worker, then the gateway...", flush=True)
        logs = {"worker": work / "worker.log", "gateway": work / "gateway.log"}

        def start(name: str, *command: str) -> None:
            children[name] = subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env=env,
                                              stdout=open(logs[name], "ab"), stderr=subprocess.STDOUT,
                                              start_new_session=True)

        start("worker", "worker", "serve", "--checkpoint", checkpoint, "--redis-url", server.url, "--metrics-port",
              str(metrics), "--metrics-host", "127.0.0.1")
        wait_for(f"http://127.0.0.1:{metrics}/readyz", children["worker"], "worker", logs["worker"], 300, stop)
        # The gateway once the worker says what it serves: the aliases name it.
        served = served_names(server.url)
        named = aliases(args.model_alias, served[0])
        keys = ["--api-keys-file", str(Path(args.api_keys_file).resolve())] if args.api_keys_file else []
        start("gateway", "producer.gateway", "--redis-url", server.url, "--port", str(args.gateway_port), *keys,
              *(flag for alias in named for flag in ("--model-alias", alias)))
        wait_for(f"http://127.0.0.1:{args.gateway_port}/health", children["gateway"], "gateway", logs["gateway"], 60,
                 stop)
        print(banner(args, server.url, gateway, metrics, work, [*served, *(a.split("=")[0] for a in named)]),
              flush=True)
        while not stop:
            for name, child in children.items():
                if child.poll() is not None:
                    print(f"stack: the {name} exited with {child.returncode}; its log: {logs[name]}",
                          file=sys.stderr)
                    return True
            time.sleep(0.2)
        print("stack: stopping...", flush=True)
        for child in children.values():  # before Redis stops: the worker drains into it
            child.terminate()
        for child in children.values():
            child.wait(60)
        return False


def banner(args: argparse.Namespace, redis_url: str, gateway: str, metrics: int, work: Path,
           names: list[str]) -> str:
    """What the stack prints once every part answers: where each is, and what to try."""
    default_redis = redis_url == "redis://127.0.0.1:6379/0"
    same = default_redis and args.gateway_port == 8080
    keyed = bool(args.api_keys_file)
    model, *others = names
    known = ", also as " + ", ".join(f"{name} (the System One SDKs' default)" if name == DEFAULT_MODEL else name
                                     for name in others)
    text = f"""
{UP}
  Redis    {redis_url}{"" if default_redis else f"   (export DQ_REDIS_URL={redis_url} for the Python client)"}
  gateway  {gateway}   (its routes: {gateway}/docs; {"API keys: " + args.api_keys_file if keyed else
                                                      "no API keys: any caller on this machine"})
  model    {model}{known if others else ""}
  worker   metrics http://127.0.0.1:{metrics}/metrics, ready at /readyz
  logs     {work}

Try (the README's snippets work as they are{"" if same else ", with these addresses"}{
    "; the gateway's calls need a key of the keys file" if keyed else ""}):
""" + "\n".join(f"  {command}" for command in commands(redis_url, gateway, default_redis)) + f"""

A System One client (typesafe-sdk, @typesafe-ai/sdk) needs its base URL only{"" if keyed else " (any API key)"}:
  export TYPESAFE_BASE_URL={gateway} TYPESAFE_API_KEY={"<a key of the keys file>" if keyed else "any-value"}
"""
    if shutil.which("redis-cli") is None:
        text += """
No redis-cli here? The protocol snippets need one (Debian, Ubuntu: apt-get install redis-tools; macOS: brew install
redis); the Python client and dq-producer need none.
"""
    return text + f"\n{LAST}"


if __name__ == "__main__":
    sys.exit(main())
