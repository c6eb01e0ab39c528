"""Cancel requests and ask where they are (docs/PROTOCOL.md, "Cancelling" and "Status"): plans of the core
(producer/client/plans.py) that both client faces run (``Client.cancel``, ``Client.status``), and
``dq-producer cancel`` and ``status`` (producer/cli/control.py).

A cancel is one call of the cancel function per shard and batch of up to 1000 ids (producer/wire/records.py
says what it does). A status is two pipelined round trips for any number of ids: each request's record and
whether its result stream exists; then, for those still in a stream, their entry's place in the pending list
and the stream's group, and a fan-out's finished parts. It reads no payload, so the monitor role may ask it
too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis

from ..plumbing.commands import Command, Pipeline, command, fcall
from ..wire import library
from ..wire.errors import LibraryUnavailable
from ..wire.keys import GROUP, ID_PATTERN, Keys, Record, RecordState, shard_of, text
from ..wire.records import Cancel, Status, cancel_of, status_of
from .plans import InvalidRequest, Load, NotDurable, Plan, Producer, first_result, written

CANCELS_SINCE = 4  # the library's revision that brought cancel (a later one may be loaded meanwhile)


def _ids(request_ids: Iterable[str] | str) -> list[str]:
    """Each id once, in order; one id given alone is one id (not its characters)."""
    ids = list(dict.fromkeys([request_ids] if isinstance(request_ids, str) else request_ids))
    for request_id in ids:
        if not isinstance(request_id, str) or not ID_PATTERN.match(request_id):
            raise InvalidRequest(f"{str(request_id)[:140]!r} is not a request id (1-128 characters of "
                                 "A-Z a-z 0-9 . _ : -)")
    return ids


def cancel(core: Producer, request_ids: Iterable[str] | str) -> Plan[dict[str, Cancel]]:
    """Cancel each request (docs/PROTOCOL.md, "Cancelling"): what each cancel did, by id, in order. Durable
    mode: NotDurable names the ids whose cancel the replicas did not confirm (cancel them again: it is
    idempotent)."""
    ids, found = _ids(request_ids), {}
    by_shard: dict[int, list[str]] = {}
    for request_id in ids:
        by_shard.setdefault(shard_of(request_id, core.shards), []).append(request_id)
    for shard, shard_ids in sorted(by_shard.items()):
        keys = Keys(core.keys.namespace, shard)
        for start in range(0, len(shard_ids), library.MAX_BATCH):
            batch = shard_ids[start: start + library.MAX_BATCH]
            call = fcall(library.CANCEL, [keys.cancels, keys.cancel_counts, *map(keys.record, batch)],
                         [int(time.time() * 1000), *batch])
            reply, replicas = yield from _call(call, core.wait_replicas)
            if core.wait_replicas and replicas < core.wait_replicas:
                raise NotDurable(f"{len(batch)} cancels made on the primary, but {replicas} of "
                                 f"{core.wait_replicas} replicas confirmed them: cancel them again", batch,
                                 replicas, core.wait_replicas)
            found.update((request_id, cancel_of(request_id, answer)) for request_id, answer in zip(batch, reply))
    # A worker publishes a result before its record says so: one published meanwhile makes the cancel too
    # late.
    held = [request_id for request_id in ids if found[request_id].state == "cancelling"]
    if held:
        reads = yield Pipeline([command("XRANGE", core.keys.result(r), "-", "+", "COUNT", 1) for r in held])
        for request_id, entries in zip(held, reads):
            if (result := first_result(entries, request_id)) is not None:
                found[request_id] = cancel_of(request_id, ["answered", result.status, getattr(
                    result.error.code, "value", result.error.code) if result.error else ""])
    return {request_id: found[request_id] for request_id in ids}


def _call(call: Command, replicas: int) -> Plan[tuple[Any, int]]:
    """A function call (``plans.written``: in durable mode, with the replicas that confirmed it), the library
    loaded first where the server has none; a server with an older revision (no cancel function) is said
    plainly."""
    for attempt in range(2):
        try:
            return (yield from written(call, replicas))
        except redis.ResponseError as error:
            if not library.missing(error):
                raise
            if attempt == 0:
                loaded = yield Load()
                if loaded.revision >= CANCELS_SINCE:
                    continue
            raise LibraryUnavailable(f"the function library on this server has no {call.words[1]} "
                                     f"(revision {CANCELS_SINCE}): "
                                     f"upgrade the workers, or run `dq-worker load-functions` as admin") from None
    raise AssertionError("unreachable")


def status(core: Producer, request_ids: Iterable[str] | str) -> Plan[dict[str, Status]]:
    """Where each request is (docs/PROTOCOL.md, "Status"), by id, in order; two round trips, no payload
    read."""
    ids = _ids(request_ids)
    records = {r: Keys(core.keys.namespace, shard_of(r, core.shards)).record(r) for r in ids}
    first = yield Pipeline([call for r in ids for call in (command("HGETALL", records[r]),
                                                           command("EXISTS", core.keys.result(r)))])
    found = {r: {text(name): text(value) for name, value in (first[2 * i] or {}).items()}
             for i, r in enumerate(ids)}
    results = {r: bool(first[2 * i + 1]) for i, r in enumerate(ids)}
    # Second: each entry's place in the pending list and its stream's group, a fan-out's finished parts.
    calls: list[Command] = []
    pending_at, groups_at, parts_at = {}, {}, {}
    for r, record in found.items():
        state, stream, entry = record.get(Record.STATE), record.get(Record.STREAM), record.get(Record.ENTRY)
        if state in (RecordState.QUEUED, None) and stream and entry:  # None: a plain XADD's, once taken
            pending_at[r] = len(calls)
            calls.append(Command(("XPENDING", stream, GROUP, entry, entry, 1), stream, {"parse_detail": True}))
            if stream not in groups_at:
                groups_at[stream] = len(calls)
                calls.append(Command(("XINFO GROUPS", stream), stream))
        elif state == RecordState.FANNED_OUT:
            parts_at[r] = len(calls)
            calls.append(command("HLEN", core.keys.shares(r)))
    second = (yield Pipeline(calls, raising=False)) if calls else []
    for reply in second:
        if isinstance(reply, redis.exceptions.NoPermissionError):
            raise reply
    out = {}
    for r in ids:
        record, pending, group, parts_done = found[r], None, None, None
        if r in pending_at:
            reply = second[pending_at[r]]
            if isinstance(reply, list) and reply:
                pending = {"consumer": text(reply[0]["consumer"]), "deliveries": int(reply[0]["times_delivered"])}
            groups = second[groups_at[record[Record.STREAM]]]
            group = next(({text(k): text(v) if isinstance(v, bytes) else v for k, v in g.items()}
                          for g in (groups if isinstance(groups, list) else []) if text(g["name"]) == GROUP), None)
        if r in parts_at and isinstance(second[parts_at[r]], int):
            parts_done = second[parts_at[r]]
        out[r] = status_of(r, record, results[r], pending, group, parts_done)
    return out
