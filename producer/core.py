"""The producer's core: all of its logic and no socket, shared by ``Client`` and ``AsyncClient`` (client.py).

``Producer`` plans every Redis exchange: each operation is a generator that yields what to send
(a ``Call``, a ``Pipeline``, a ``Function`` call or a ``Load`` of the function library) and is sent the reply, or
has the error thrown in. The two faces only run those plans against their connection: ``Client`` blocks,
``AsyncClient`` awaits. So batching, backpressure, the windowed wait, result parsing and stats are written once,
and the faces have the same methods. ``Producer.send`` is the one place that writes to a request stream.

Submitting is one call of the submit function (producer/library.py) per batch: it checks each id and body size
and refuses the batch when the request stream holds more than ``max_unfinished`` entries (its length is the
unfinished work). A request goes to its lane's stream, so the limit holds per lane.
Waiting is a blocking ``XREAD`` on the result streams of up to 256 awaited requests at once (a result keeps its
one entry until its TTL); on Redis Cluster, where one read cannot span slots, on the oldest one, then a pipelined
look at the others.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import redis
from pydantic import ValidationError

from . import library
from .errors import InvalidRequest, QueueFull, ResultTimeout, WrongResult  # noqa: F401 - raised here, imported from here
from .keys import GONE_S, GROUP, LANES, MAX_BODY_BYTES, NORMAL, Field, Keys, Priority, beat_age, shard_of
from .schema import Request, describe, digest
from .result import Result
from .servers import lag_of

BATCH = 500  # requests per submit call (library.MAX_BATCH at most): bounds the time Redis spends in one call
BLOCK_MS = 1000  # kept well below the socket timeout, so a blocking read never looks like a dead connection
WINDOW = 256  # result streams one blocking read waits on (any of them landing wakes it)
# A "function not found" reply means nothing ran: load the library and call again. The server may lose it again
# in between (restarts, failovers, FUNCTION FLUSH in a row): a few tries, then the error goes to the caller.
LOAD_TRIES = 5
T = TypeVar("T")


class Prepared(NamedTuple):
    """A validated request, serialized: its id (given or generated), the entry body, and the lane it goes to."""

    id: str
    body: str
    lane: Priority = NORMAL


Submittable = Request | Mapping[str, Any] | Prepared


def prepare(request: Submittable, max_bytes: int = MAX_BODY_BYTES) -> Prepared:
    """Validate, give an id if it has none, serialize. A ``Prepared`` passes through as it is."""
    if isinstance(request, Prepared):
        return request
    try:
        parsed = request if isinstance(request, Request) else Request.model_validate(request)
    except ValidationError as error:
        raise InvalidRequest(describe(error)) from None
    if parsed.id is None:
        parsed = parsed.model_copy(update={"id": uuid.uuid4().hex})
    body = parsed.model_dump_json(exclude_none=True)
    if len(body.encode()) > max_bytes:
        raise InvalidRequest(f"request is {len(body.encode())} bytes, over the {max_bytes}-byte limit")
    return Prepared(parsed.id, body, Priority(parsed.priority or NORMAL))


@dataclass(frozen=True)
class Call:
    """One Redis command: the redis-py method and its arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """Commands sent in one round trip (no transaction); the reply is the list of their replies."""

    calls: list[Call]


@dataclass(frozen=True)
class Function:
    """A call of one function of the library (``FCALL``)."""

    name: str
    keys: list[str]
    args: list[Any]


@dataclass(frozen=True)
class Load:
    """Load the function library if the server has none (``library.ensure``): the reply is a ``library.Loaded``,
    or ``library.LibraryUnavailable`` is thrown in."""


Step = Call | Pipeline | Function | Load
Plan = Generator[Step, Any, T]


def parse_result(fields: Mapping[bytes, bytes], request_id: str) -> Result:
    """The result entry read from ``request_id``'s result stream; raises WrongResult unless it is that request's."""
    result = Result.model_validate_json(fields[Field.BODY.encode()])
    if result.id != request_id:
        raise WrongResult(f"the result stream of request {request_id!r} holds a result for {result.id[:140]!r}")
    return result


class Producer:
    """The producer's logic without I/O: every operation returns a plan that a face runs."""

    def __init__(self, keys: Keys, shards: int, max_unfinished: int, cluster: bool) -> None:
        self.keys, self.shards, self.max_unfinished, self.cluster = keys, shards, max_unfinished, cluster

    @property
    def batch_size(self) -> int:
        """Requests per submit call: at most ``BATCH``, and never more than the limit lets in at once."""
        return min(BATCH, self.max_unfinished) if self.max_unfinished > 0 else BATCH

    def submit_many(self, requests: Iterable[Submittable]) -> Plan[list[str]]:
        """Validate every request first (InvalidRequest: nothing sent), then send each shard's in batches, to each
        lane's stream, the high lane's first."""
        prepared, given = [], list(requests)
        for index, request in enumerate(given):
            try:
                prepared.append(prepare(request))
            except InvalidRequest as error:
                raise (InvalidRequest(str(error), index) if len(given) > 1 else error) from None
        ids = [p.id for p in prepared]
        sent = [False] * len(prepared)
        by_stream: dict[tuple[int, Priority], list[int]] = {}
        for index, item in enumerate(prepared):
            by_stream.setdefault((LANES.index(item.lane), shard_of(item.id, self.shards)), []).append(index)
        for (lane, shard), indexes in sorted(by_stream.items()):
            for start in range(0, len(indexes), self.batch_size):
                batch = indexes[start: start + self.batch_size]
                try:
                    yield from self.send([prepared[i] for i in batch], shard, LANES[lane])
                except QueueFull as full:
                    raise QueueFull(full.detail, [r for r, done in zip(ids, sent) if done],
                                    [r for r, done in zip(ids, sent) if not done]) from None
                for index in batch:
                    sent[index] = True
        return ids

    def send(self, batch: Sequence[Prepared], shard: int = 0, lane: Priority = NORMAL) -> Plan[None]:
        """Enqueue prepared requests on one shard's lane, all or none; raises QueueFull. Every request goes through
        here: the lane's request stream is the submit function's key."""
        stream = Keys(self.keys.namespace, shard).requests_in(lane)
        args = [self.max_unfinished, *(value for item in batch for value in (item.id, item.body))]
        for attempt in range(LOAD_TRIES):
            try:
                yield Function(library.SUBMIT, [stream], args)
                return
            except redis.ResponseError as error:
                text = str(error)
                if library.missing(error) and attempt < LOAD_TRIES - 1:  # nothing was enqueued
                    yield Load()
                    continue
                if text.startswith("QUEUEFULL"):
                    raise QueueFull(f"shard {shard}, {lane} lane: {text[len('QUEUEFULL '):]}") from None
                if text.startswith("INVALID"):  # the function's checks are the schema's: a bug of one or the other
                    raise InvalidRequest(text[len("INVALID "):]) from None
                raise

    def fetch(self, request_id: str) -> Plan[Result | None]:
        """The result if it is there (non-blocking)."""
        reply = yield Call("xrange", (self.keys.result(request_id),), {"count": 1})
        return parse_result(reply[0][1], request_id) if reply else None

    def wait_many(self, request_ids: Iterable[str], timeout: float | None) -> Plan[dict[str, Result]]:
        """Results of all ``request_ids`` in their order; raises ResultTimeout naming how many are missing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = list(dict.fromkeys(request_ids))
        done = yield from self.present(waiting)
        while len(done) < len(waiting):
            missing = [r for r in waiting if r not in done]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ResultTimeout(f"{len(missing)} of {len(waiting)} results not there yet", done, missing)
            block = BLOCK_MS if left is None else max(1, min(BLOCK_MS, int(left * 1000)))
            window = {self.keys.result(r): r for r in missing[: 1 if self.cluster else WINDOW]}
            reply = yield Call("xread", (dict.fromkeys(window, "0-0"),), {"count": 1, "block": block})
            for key, entries in reply or []:
                request_id = window[key.decode() if isinstance(key, bytes) else key]
                done[request_id] = parse_result(entries[0][1], request_id)
            if self.cluster and reply:  # one key per read there: when the oldest lands, look at the rest
                done.update((yield from self.present(missing[1:])))
        return {r: done[r] for r in waiting}

    def present(self, request_ids: list[str]) -> Plan[dict[str, Result]]:
        """The results already there, in one round trip (one key per command: fine on Redis Cluster too)."""
        if not request_ids:
            return {}
        replies = yield Pipeline([Call("xrange", (self.keys.result(r),), {"count": 1}) for r in request_ids])
        return {r: parse_result(reply[0][1], r) for r, reply in zip(request_ids, replies) if reply}

    def decide(self, request: Submittable, timeout: float | None) -> Plan[Result]:
        """Submit, wait; a stored result of another request under the same id is answered ``id_conflict``."""
        prepared = prepare(request)
        [request_id] = yield from self.submit_many([prepared])
        result = (yield from self.wait_many([request_id], timeout))[request_id]
        return result.answering(digest(Request.model_validate_json(prepared.body)))

    def stats(self) -> Plan[dict[str, Any]]:
        """Totals over every shard, then each shard: for each lane (``lanes``: high, normal) the request and part
        streams' lengths and the worker group's pending, lag and live consumers; ``requests`` and ``prompts``: both
        lanes together; dead letters; and the live workers. Live: a consumer seen in the last ``GONE_S`` seconds or
        holding entries, a worker whose heartbeat is younger than that (workers delete the gone: presence.py). The
        lag is the server's, or the length less pending when the server cannot count it (``servers.lag_of``)."""
        shards = []
        for shard in range(self.shards):
            keys, entry = Keys(self.keys.namespace, shard), {"shard": shard}
            lanes: dict[str, dict[str, Any]] = {}
            for lane in LANES:  # plain str keys: the dict is printed and dumped as it is
                lanes[lane.value] = {}
                for name, stream in (("requests", keys.requests_in(lane)), ("chunks", keys.parts_in(lane))):
                    lanes[lane.value][name] = yield from self._stream_stats(stream)
            for name in ("requests", "chunks"):
                entry[name] = _combine([lanes[lane.value][name] for lane in LANES], consumers=max)
            entry["lanes"] = lanes
            entry["dead_letters"] = yield Call("xlen", (keys.dead,))
            shards.append(entry)
        totals: dict[str, Any] = {name: _combine([s[name] for s in shards]) for name in ("requests", "chunks")}
        totals["lanes"] = {lane.value: {name: _combine([s["lanes"][lane.value][name] for s in shards])
                                        for name in ("requests", "chunks")} for lane in LANES}
        totals["dead_letters"] = sum(s["dead_letters"] for s in shards)
        beats = yield Call("hgetall", (self.keys.workers(),))
        now = time.time()
        totals["workers"] = sum(1 for raw in beats.values() if beat_age(raw, now) < GONE_S)
        return {**totals, "shards": shards}

    def live_workers(self) -> Plan[int | None]:
        """Workers of this namespace whose heartbeat is younger than ``GONE_S`` (any shard); None when this user may
        not read the heartbeat hash (an aclfile older than the producer's read of it)."""
        try:
            beats = yield Call("hgetall", (self.keys.workers(),))
        except redis.exceptions.NoPermissionError:
            return None
        now = time.time()
        return sum(1 for raw in beats.values() if beat_age(raw, now) < GONE_S)

    def _stream_stats(self, stream: str) -> Plan[dict[str, Any]]:
        """One stream's length, and the worker group's pending, lag and consumers on it (once the group exists)."""
        stream_stats = {"length": (yield Call("xlen", (stream,)))}
        try:
            groups = yield Call("xinfo_groups", (stream,))
        except redis.ResponseError as error:
            if "no such key" not in str(error).lower():  # NOPERM and the like are the caller's to see
                raise
            groups = []
        for group in groups:
            if group["name"] in (GROUP, GROUP.encode()):
                consumers = yield Call("xinfo_consumers", (stream, GROUP))
                stream_stats.update(pending=group["pending"],
                                    lag=lag_of(stream_stats["length"], group["pending"], group.get("lag")),
                                    consumers=sum(1 for c in consumers if c["pending"] or c["idle"] < GONE_S * 1000))
        return stream_stats


def _combine(parts: list[dict[str, Any]], consumers: Any = sum) -> dict[str, Any]:
    """Field-wise sum of stream stats; ``consumers`` combines consumer counts (``max`` over one shard's lanes)."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if name == "consumers":
                out[name] = consumers((out.get(name, 0), value))
            else:
                out[name] = None if value is None or out.get(name, 0) is None else out.get(name, 0) + value
    return out
