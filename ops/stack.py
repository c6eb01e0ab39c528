"""The local stack: a Redis (the embedded Valkey unless a server is installed), a worker on the tiny checkpoint and
the gateway, up until Ctrl-C, for trying the README's snippets (they use these addresses by default).

    bash ops/stack.sh                                  # Redis on 127.0.0.1:6379, the gateway on localhost:8080
    bash ops/stack.sh --redis-port 6380 --gateway-port 8081     # where those are taken

The checkpoint has random weights: its answers are arbitrary; the stack shows the paths (the Python client, the
gateway, the protocol, dq-producer), not a model's judgement. Nothing is kept: the data and the checkpoint are in
a temporary directory, removed at the end.
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

UP = "stack: up"  # the line that says every part answers (tests wait for it)
REQUEST = '{"state": "I was charged twice.", "questions": {"refund": {"type": "noul"}}}'


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/stack.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-port", type=int, default=6379, help="Redis' port on 127.0.0.1 [default 6379]")
    parser.add_argument("--gateway-port", type=int, default=8080, help="the gateway's port [default 8080]")
    parser.add_argument("--checkpoint", default="", help="serve this checkpoint instead of the tiny one")
    args = parser.parse_args(argv)
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
        print(f"stack: {server.server} ({where}) on {server.url}; starting a worker and the gateway...", flush=True)
        logs = {"gateway": work / "gateway.log", "worker": work / "worker.log"}
        starts = {"gateway": ["producer.gateway", "--redis-url", server.url, "--port", str(args.gateway_port)],
                  "worker": ["worker", "serve", "--checkpoint", checkpoint, "--redis-url", server.url,
                             "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1"]}
        for name, command in starts.items():
            children[name] = subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env=env,
                                              stdout=open(logs[name], "ab"), stderr=subprocess.STDOUT,
                                              start_new_session=True)
        wait_for(f"http://127.0.0.1:{args.gateway_port}/health", children["gateway"], "gateway", logs["gateway"], 60,
                 stop)
        wait_for(f"http://127.0.0.1:{metrics}/readyz", children["worker"], "worker", logs["worker"], 300, stop)
        default_redis = server.url == "redis://127.0.0.1:6379/0"
        same = default_redis and args.gateway_port == 8080
        print(f"""
{UP} (Ctrl-C stops it and removes what it made)
  Redis    {server.url}{"" if default_redis else f"   (export DQ_REDIS_URL={server.url} for the Python client)"}
  gateway  {gateway}   (its routes: {gateway}/docs)
  worker   metrics http://127.0.0.1:{metrics}/metrics, ready at /readyz
  logs     {work}

Try (the README's snippets work as they are{"" if same else ", with these addresses"}):
""" + "\n".join(f"  {command}" for command in commands(server.url, gateway, default_redis)) + """

No redis-cli here? The protocol snippets need one (Debian, Ubuntu: apt-get install redis-tools; macOS: brew install
redis); the Python client and dq-producer need none.
""", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
