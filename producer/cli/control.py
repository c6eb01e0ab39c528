"""``dq-producer cancel`` and ``dq-producer status``: ids from the arguments or a file, one JSON line per id,
the exit code from what the answers say (the plans they run: producer/client/control.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..client import InvalidRequest
from ..plumbing.exits import FAILED, OK, USAGE


def _read_ids(args: argparse.Namespace) -> list[str]:
    ids = list(args.ids)
    if args.file:
        with sys.stdin if args.file == "-" else open(args.file, encoding="utf-8") as handle:
            ids += [line.strip() for line in handle if line.strip()]
    if not ids:
        raise InvalidRequest("no ids: give them as arguments or with --file")
    return ids


def _run(args: argparse.Namespace, ask: Any, failed: str) -> int:
    """One JSON line per id; exit 0, 1 when one says ``failed``, 2 for a bad id or file."""
    try:
        found = ask(_read_ids(args))
    except (InvalidRequest, OSError) as error:
        print(f"dq-producer {args.command}: {error}", file=sys.stderr)
        return USAGE
    for answer in found.values():
        print(answer.model_dump_json(exclude_none=True))
    return FAILED if any(answer.state == failed for answer in found.values()) else OK


def run_cancel(args: argparse.Namespace, client: Any) -> int:
    return _run(args, client.cancel, "too_late")


def run_status(args: argparse.Namespace, client: Any) -> int:
    return _run(args, client.status, "unknown")


CANCEL = ("Cancel requests: a queued one is never computed and is answered `cancelled`; one a worker holds "
          "is answered `cancelled` unless a prompt of it is already packed (then normally). One JSON line "
          "per id: cancelled, cancelling (its worker decides), too_late (already answered: exit 1) or "
          "unknown.")
STATUS = ("Where requests are: queued (lane, how many ahead), in_progress (worker, since, deliveries), "
          "answered, cancelled, dead_lettered or unknown (exit 1). One JSON line per id; reads no payload "
          "(the monitor user may run it).")


def add_parsers(commands: Any, common: argparse.ArgumentParser) -> None:
    for name, run, text_ in (("cancel", run_cancel, CANCEL), ("status", run_status, STATUS)):
        sub = commands.add_parser(name, parents=[common], help=text_.split(":")[0].split(".")[0].lower(),
                                  description=text_)
        sub.add_argument("ids", nargs="*", metavar="ID", help="request ids")
        sub.add_argument("--file", metavar="FILE",
                         help="more ids, one per line (- for stdin) [default: none]")
        sub.set_defaults(run=run)
