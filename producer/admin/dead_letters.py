"""dq-producer dead: list, requeue and purge dead letters, the entries workers gave up on (delivered more than
--max-deliveries times), as the admin user: the dead-letter stream holds request payloads, which no other role
may read, and requeue and purge write to the work streams.

    dq-producer dead list [--bodies]              one JSON line per dead letter: where it was, why, when
    dq-producer dead requeue DEAD_ID... | --all   back to the stream and lane it came from (--shard N: one shard), to be answered again
    dq-producer dead purge DEAD_ID... | --all     delete them

A requeued request was answered dead_lettered; that result is deleted first (only an error result with that
code), so that the worker's new answer is the one published (the first publication of a result wins). On one
server the check, the deletion, the entry added back and the dead letter deleted are one step (the library's
requeue function), as a worker's dead letter and its result are: a requeue never runs between the two. A request
sent without an id is answered under its new entry id. A part entry (of a fanned-out request) is not requeued:
its request was answered and its stored body may be gone; submit the request again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import redis

from ..plumbing.exits import FAILED, OK, USAGE
from ..plumbing import library_loader
from ..wire import library
from ..wire.keys import ENTRY_ID_SHAPE, LANES, Field, Keys, Priority, text, valid_id
from ..wire.schema import ErrorCode

PAGE = 100  # entries read per XRANGE
OWN = {f.encode() for f in (Field.STREAM, Field.LANE, Field.ENTRY_ID, Field.DELIVERIES, Field.REASON)}


def _text(value: bytes, limit: int = 4000) -> str:
    """Dead letters hold whatever the entry held: shown as text, undecodable bytes replaced, long ones cut."""
    text = value.decode(errors="replace")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _request_id(fields: dict[bytes, bytes]) -> str | None:
    try:
        given = json.loads(fields.get(Field.BODY.encode(), b""))
    except ValueError:
        return None
    # only an id a worker would answer under: a hostile one never names a key to look at or delete
    return given.get("id") if isinstance(given, dict) and valid_id(given.get("id")) else None


def entries(connection: Any, keys: Keys) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Every dead letter of a shard, oldest first, read a page at a time."""
    start = "-"
    while True:
        page = connection.xrange(keys.dead, start, "+", count=PAGE)
        for entry_id, fields in page:
            yield entry_id.decode(), fields
        if len(page) < PAGE:
            return
        start = "(" + page[-1][0].decode()


def describe(dead_id: str, shard: int, fields: dict[bytes, bytes], bodies: bool) -> dict[str, Any]:
    def own(field: str) -> str | None:
        value = fields.get(field.encode())
        return None if value is None else _text(value)

    record: dict[str, Any] = {"dead_id": dead_id, "shard": shard, "stream": own(Field.STREAM),
                              "lane": own(Field.LANE), "entry_id": own(Field.ENTRY_ID),
                              "deliveries": own(Field.DELIVERIES), "reason": own(Field.REASON),
                              "request_id": _request_id(fields) or own(Field.REQUEST_ID),
                              "dead_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                       time.gmtime(int(dead_id.split("-")[0]) / 1000))}
    if bodies:
        record["fields"] = {_text(k, 200): _text(v) for k, v in fields.items() if k not in OWN}
    return record


def requeue_one(connection: Any, keys: Keys, dead_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """Put one dead letter back where it was; what was done, or why not (``skipped``)."""
    stream, lane = fields.get(Field.STREAM.encode(), b"").decode(errors="replace"), None
    try:
        lane = Priority(fields.get(Field.LANE.encode(), b"normal").decode())
    except ValueError:
        pass
    if stream != "requests" or lane not in LANES:
        why = ("a part of a fanned-out request: submit the request again" if stream == "chunks"
               else f"it names no request stream and lane (stream {stream[:40]!r})")
        return {"dead_id": dead_id, "skipped": why}
    original = {k: v for k, v in fields.items() if k not in OWN}
    request_id = _request_id(fields)
    target = keys.requests_in(lane)
    if not isinstance(connection, redis.RedisCluster):  # one step (their keys span slots on a cluster)
        result_key = [keys.result(request_id)] if request_id is not None else []
        reply = connection.fcall(library.REQUEUE, 2 + len(result_key), keys.dead, target, *result_key, dead_id,
                                 keys.group)
        if text(reply[0]) == "requeued":
            return {"dead_id": dead_id, "requeued": target, "request_id": request_id}
        why = {"gone": "no such dead letter: requeued or purged meanwhile",
               "empty": "the dead letter holds none of its entry's fields",
               "pending": "its entry is still pending: its worker has not acknowledged it yet (one that died is "
                          "dead-lettered again once reclaimed); try again"}.get(text(reply[0]))
        return {"dead_id": dead_id, "skipped": why or f"request {request_id} is answered ({text(reply[1])}): its "
                                                      f"result stays, nothing requeued"}
    if request_id is not None:
        found = connection.xrange(keys.result(request_id), count=1)
        if found:
            try:
                result = json.loads(found[0][1].get(Field.BODY.encode(), b"{}"))
            except ValueError:
                result = {}
            code = (result.get("error") or {}).get("code") if isinstance(result, dict) else None
            if code != ErrorCode.DEAD_LETTERED.value:
                return {"dead_id": dead_id, "skipped": f"request {request_id} is answered ({code or 'ok'}): "
                                                        f"its result stays, nothing requeued"}
            connection.delete(keys.result(request_id))  # before the entry exists: the new answer must land
    connection.xadd(target, original)
    connection.xdel(keys.dead, dead_id)
    return {"dead_id": dead_id, "requeued": target, "request_id": request_id}


def _chosen(connection: Any, namespace: str, shards: list[int], ids: list[str], every: bool
            ) -> Iterator[tuple[Keys, str, dict[bytes, bytes] | str]]:
    """The dead letters asked for, by shard; an id found in no shard, or in several (each shard's stream numbers
    its own entries), comes with why it is not taken."""
    for dead_id in ids:
        found = [(shard, entry) for shard in shards
                 for entry in connection.xrange(Keys(namespace, shard).dead, dead_id, dead_id)]
        if len(found) == 1:
            yield Keys(namespace, found[0][0]), dead_id, found[0][1][1]
        else:
            yield Keys(namespace, shards[0]), dead_id, (
                "no such dead letter" if not found else
                f"in shards {', '.join(str(shard) for shard, _ in found)}: say which with --shard")
    if every:
        for shard in shards:
            keys = Keys(namespace, shard)
            for dead_id, fields in list(entries(connection, keys)):  # read before changing the stream
                yield keys, dead_id, fields


def run(args: argparse.Namespace, client: Any) -> int:
    connection, namespace = client.redis, client.deployment.namespace
    if args.shard is not None and not 0 <= args.shard < client.shards:
        print(f"dq-producer dead: --shard {args.shard} is not one of the {client.shards} shards (--shards)",
              file=sys.stderr)
        return USAGE
    shards = list(range(client.shards)) if args.shard is None else [args.shard]
    if args.action == "list":
        for shard in shards:
            for dead_id, fields in entries(connection, Keys(namespace, shard)):
                print(json.dumps(describe(dead_id, shard, fields, args.bodies), ensure_ascii=False))
        return OK
    if bool(args.ids) == args.all:
        print(f"dq-producer dead {args.action}: give dead-letter ids or --all (not both)", file=sys.stderr)
        return USAGE
    for dead_id in args.ids:  # Redis refuses another in XRANGE: read as unreachable (4), it is a usage error
        if not ENTRY_ID_SHAPE.match(dead_id):
            print(f"dq-producer dead {args.action}: {dead_id[:60]!r} is not a dead-letter id (an entry id such as "
                  "1767225600000-0, as dead list shows them)", file=sys.stderr)
            return USAGE
    if args.action == "requeue":
        library_loader.ensure(connection)  # the requeue function (revision 4): the admin user may load it
    done = skipped = 0
    for keys, dead_id, fields in _chosen(connection, namespace, shards, args.ids, args.all):
        if isinstance(fields, str):
            outcome: dict[str, Any] = {"dead_id": dead_id, "skipped": fields}
        elif args.action == "purge":
            outcome = {"dead_id": dead_id, "purged": bool(connection.xdel(keys.dead, dead_id))}
        else:
            outcome = requeue_one(connection, keys, dead_id, fields)
        skipped += "skipped" in outcome
        done += "skipped" not in outcome
        print(json.dumps(outcome, ensure_ascii=False))
    verb = "requeued" if args.action == "requeue" else "purged"
    print(f"{done + skipped} dead letters: {done} {verb}" + (f", {skipped} skipped" if skipped else ""),
          file=sys.stderr)
    return OK if not skipped else FAILED


def checked(args: argparse.Namespace, client: Any) -> int:
    """``run``, with a refusal by the server's ACL said plainly (NOPERM: only the admin user may)."""
    try:
        return run(args, client)
    except redis.exceptions.NoPermissionError as error:
        print(f"dq-producer dead: refused by Redis ({error}): the dead-letter tools need the admin user "
              "(docs/OPERATIONS.md, Redis ACL users)", file=sys.stderr)
        return FAILED


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    dead = commands.add_parser("dead", parents=[common], help="list, requeue or purge dead letters (admin user)",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dead.add_argument("action", choices=("list", "requeue", "purge"), help="what to do")
    dead.add_argument("ids", nargs="*", metavar="DEAD_ID", help="dead-letter entry ids (as list shows them)")
    dead.add_argument("--all", action="store_true", help="every dead letter of every shard [default off]")
    dead.add_argument("--shard", type=int, default=None, metavar="N",
                      help="only this shard's dead letters (ids are numbered per shard) [default: every shard]")
    dead.add_argument("--bodies", action="store_true",
                      help="list: the entry's own fields too (request payloads) [default off]")
    dead.set_defaults(run=checked)
