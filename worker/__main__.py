"""dq-worker (or python -m worker): serve, write a tiny checkpoint, or check a running worker's health."""

from __future__ import annotations

import argparse
import os
import sys

from producer import __version__
from producer.keys import PROTOCOL

from .config import Settings


def _tiny(args: argparse.Namespace) -> int:
    from .model import tiny

    path = tiny.write(args.directory, seed=args.seed, fmt=args.format, multimodal=not args.text_only)
    print(f"wrote a tiny {args.format} decision checkpoint to {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dq-worker", description=__doc__)
    top.add_argument("--version", action="version",
                     version=f"dq-worker {__version__} (decision-queue, wire protocol v{PROTOCOL})")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny_cmd = commands.add_parser("tiny-checkpoint", help="write a tiny random Qwen3.5 decision checkpoint")
    tiny_cmd.add_argument("directory", help="where to write it (created if missing)")
    tiny_cmd.add_argument("--seed", type=int, default=0, help="seed of the random weights [default 0]")
    tiny_cmd.add_argument("--format", choices=("repo", "readout", "judge"), default="repo",
                          help="save_pretrained repo, decision_config.json + readout.safetensors, or JEV judge "
                               "[default 'repo']")
    tiny_cmd.add_argument("--text-only", action="store_true",
                          help="a qwen3_5_text backbone (no vision tower) [default off]")
    tiny_cmd.set_defaults(run=_tiny)

    serve_cmd = commands.add_parser("serve", help="consume requests from Redis and publish results")
    Settings.add_arguments(serve_cmd)
    serve_cmd.set_defaults(run=_serve)

    check_cmd = commands.add_parser("check", help="exit 0 if a worker's health endpoint answers 200")
    default_url = f"http://127.0.0.1:{os.environ.get('DQ_METRICS_PORT', '9400')}"
    check_cmd.add_argument("--url", default=default_url,
                           help=f"the worker's health endpoint [port from env DQ_METRICS_PORT, default {default_url!r}]")
    check_cmd.add_argument("--live", action="store_true",
                           help="liveness (/healthz) instead of readiness (/readyz) [default off]")
    check_cmd.set_defaults(run=lambda a: __import__("worker.health", fromlist=["check"]).check(
        a.url, "/healthz" if a.live else "/readyz"))
    return top


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser().parse_args(argv)
    return args.run(args)


def _serve(args: argparse.Namespace) -> int:
    from .daemon import serve

    try:
        settings = Settings.from_args(args)
    except ValueError as error:  # a setting out of range: named, before the model loads
        print(f"worker: {error}", file=sys.stderr)
        return 2
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
