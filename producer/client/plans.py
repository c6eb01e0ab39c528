"""The producer's core: all of its logic and no socket, shared by ``Client`` and ``AsyncClient`` (faces.py).

``Producer`` plans every Redis exchange: each operation is a generator that yields what to send (a ``Command``, a
``Pipeline`` of them, a ``Durable`` batch or a ``Load`` of the function library: steps.py) and is sent the reply, or
has the error thrown in. The two faces only run those plans against their connection: ``Client`` blocks,
``AsyncClient`` awaits. So batching, backpressure, the windowed wait, result parsing and stats are written
once, and the faces have the same methods. ``Producer.send`` is the one place that writes to a request stream.

Submitting is one call of the submit function (producer/wire/library.py) per batch: it checks each id and body
size and refuses the batch when the request stream holds more than ``max_unfinished`` entries (its length is
the unfinished work). A request goes to its lane's stream, so the limit holds per lane. Waiting is a blocking
``XREAD`` on the result streams of up to 256 awaited requests at once (a result keeps its one entry until its
TTL); on Redis Cluster, where one read cannot span slots, on the oldest one, then a pipelined look at the
others.

Whether anyone will answer (``Liveness``): a wait during which no worker of the namespace is alive (none
started, all gone, a mistyped namespace) ends after ``no_worker_s``, not after its whole timeout, saying so.
Liveness is a heartbeat younger than ``GONE_S`` (producer/wire/keys.py). It is looked at a second into a wait
that has not got its results, then every ``LOOK_S``: a wait answered at once pays nothing for it. Once a
worker is seen alive (or this user may not read the heartbeats), a wait runs its whole timeout.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import redis
from pydantic import ValidationError

from ..plumbing.commands import Command, Pipeline, command, fcall
from ..plumbing.durable import Durable
from ..wire import library
from ..wire.digest import body_digest, digest
from ..wire.errors import InvalidRequest, NotDurable, QueueFull, ResultTimeout, WrongResult  # noqa: F401 - raised here
from ..wire.keys import GONE_S, LANES, MAX_BODY_BYTES, NORMAL, Field, Keys, Priority, beat_live, shard_of
from ..wire.result import Result, Unreadable, read_stored, unreadable
from ..wire.schema import Request, describe
from .steps import Load, Plan, Step  # noqa: F401 - the faces' names for them

BATCH = 500  # requests per submit call (library.MAX_BATCH at most): bounds the time Redis spends in one call
BLOCK_MS = 1000  # kept well below the socket timeout, so a blocking read never looks like a dead connection
WINDOW = 256  # result streams one blocking read waits on (any of them landing wakes it)
REMEMBERED = 100_000  # ids whose digests a producer keeps (for id conflicts): about 300 bytes each
# A "function not found" reply means nothing ran: load the library and call again. The server may lose it
# again in between (restarts, failovers, FUNCTION FLUSH in a row): a few tries, then the error goes to the
# caller.
LOAD_TRIES = 5
NO_WORKER_S, LOOK_S = 15.0, 5.0  # a wait with no live worker ends after NO_WORKER_S; looks every LOOK_S


class Prepared(NamedTuple):
    """A validated request, serialized: its id (given or generated), the entry body, and the lane it goes to."""

    id: str
    body: str
    lane: Priority = NORMAL
    digest: str = ""  # digest.digest of the request ("": computed from the body when asked)

    def request_digest(self) -> str:
        """The request's digest: the one ``prepare`` took, else from the body."""
        return self.digest or digest(Request.model_validate_json(self.body))

    def digests(self) -> tuple[str, str]:
        """A result of this request carries the request's digest, or its body's where a worker did not validate it."""
        return self.request_digest(), body_digest(self.body)

    def answered_by(self, result: Result) -> Result:
        """``result`` if it answers this request, else ``id_conflict``: another request's under the id, or
        none's (no digest) (docs/PROTOCOL.md, "Reusing an id"). Every reader that submitted checks this."""
        return result.answering(self.digests())


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
    return Prepared(parsed.id, body, Priority(parsed.priority or NORMAL), digest(parsed))


class Liveness:
    """One wait's looks at the workers' heartbeats."""

    def __init__(self, namespace: str, no_worker_s: float | None, forever: bool) -> None:
        self.namespace, self.no_worker_s = namespace, no_worker_s
        self.started = time.monotonic()
        self.seen = no_worker_s is None or forever  # a worker seen alive, or nothing to watch for
        self.next_look = self.started + min(1.0, no_worker_s or 0.0)

    def due(self, late: bool) -> bool:
        """Whether to look now (at the deadline, always, so that a timeout can say why)."""
        return not self.seen and (late or time.monotonic() >= self.next_look)

    def looked(self, live: int | None) -> None:
        """What a look found: how many live workers (None: this user may not read the heartbeats)."""
        self.seen, self.next_look = live != 0, time.monotonic() + LOOK_S

    def gone(self, late: bool) -> bool:
        """No worker alive for the whole wait, and the wait is over (late) or has gone ``no_worker_s``."""
        return not self.seen and (late or time.monotonic() - self.started >= self.no_worker_s)  # type: ignore

    def why(self) -> str:
        return (f"; no live worker in namespace {self.namespace!r} (no heartbeat in the last {GONE_S} s: "
                "none started, or the namespace is wrong): they stay queued until one starts")


def parse_result(fields: Mapping[bytes, bytes], request_id: str) -> Result:
    """The result entry read from ``request_id``'s result stream; one that is not that request's result
    (garbage, another id's) is answered ``id_conflict`` for that id alone, never handed out, never raised for
    a whole read."""
    try:
        return read_stored(fields.get(Field.BODY.encode()), request_id)
    except Unreadable as error:
        return unreadable(request_id, error)


def first_result(entries: list | None, request_id: str) -> Result | None:
    """The first entry of ``request_id``'s result stream as read (``XRANGE ... COUNT 1``, or that stream's part
    of an ``xread``): its result, None when the stream had none."""
    return parse_result(entries[0][1], request_id) if entries else None


def landed(reply: Any, window: Mapping[str, str], durable: bool) -> tuple[dict[str, Result], list[str]]:
    """What an ``xread`` over ``window`` (result stream -> request id) found: the results, or, in durable mode,
    the ids whose results must be looked at again, confirmed (a result counts only once its replicas have it)."""
    found: dict[str, Result] = {}
    look = []
    for key, entries in reply or []:
        request_id = window[key.decode() if isinstance(key, bytes) else key]
        if durable:
            look.append(request_id)
        else:
            found[request_id] = parse_result(entries[0][1], request_id)
    return found, look


def xread(window: Iterable[str], block: int) -> Command:
    """A blocking read of the first entry of each of ``window``'s result streams, for up to ``block`` ms."""
    keys = list(window)
    return Command(("XREAD", "COUNT", 1, "BLOCK", block, "STREAMS", *keys, *["0-0"] * len(keys)), keys[0])


def written(call: Command, replicas: int) -> Plan[tuple[Any, int]]:
    """A command that writes, its reply and, in durable mode (``replicas``), how many replicas confirmed it (a
    ``Durable`` batch of one); a refusal is raised."""
    if not replicas:
        return (yield call), 0
    sent = yield Durable([call], replicas)
    if isinstance(sent.replies[0], BaseException):
        raise sent.replies[0]
    return sent.replies[0], sent.replicas[0]


class Producer:
    """The producer's logic without I/O: every operation returns a plan that a face runs."""

    def __init__(self, keys: Keys, shards: int, max_unfinished: int, cluster: bool, wait_replicas: int = 0,
                 no_worker_s: float | None = NO_WORKER_S) -> None:
        self.keys, self.shards, self.max_unfinished, self.cluster = keys, shards, max_unfinished, cluster
        self.wait_replicas = wait_replicas  # durable mode (docs/RELIABILITY.md): WAIT after each write and read
        self.no_worker_s = no_worker_s  # None: a wait with no live worker runs its whole timeout
        # The digests of what this producer last submitted under each id, lately (digests only: bodies can be
        # megabytes): a result read for one of them that is another request's (a reused id) is returned as the
        # id_conflict it is, never as this request's answer.
        self.submitted: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def _remember(self, prepared: Prepared) -> None:
        self.submitted[prepared.id] = prepared.digests()
        self.submitted.move_to_end(prepared.id)
        while len(self.submitted) > REMEMBERED:
            self.submitted.popitem(last=False)

    def _checked(self, result: Result) -> Result:
        mine = self.submitted.get(result.id)
        return result.answering(mine) if mine is not None else result

    @property
    def batch_size(self) -> int:
        """Requests per submit call: at most ``BATCH``, and never more than the limit lets in at once."""
        return min(BATCH, self.max_unfinished) if self.max_unfinished > 0 else BATCH

    def submit_many(self, requests: Iterable[Submittable]) -> Plan[list[str]]:
        """Validate every request first (InvalidRequest: nothing sent), then send each shard's in batches, to
        each lane's stream, the high lane's first."""
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
                    self._remember(prepared[index])
        return ids

    def send(self, batch: Sequence[Prepared], shard: int = 0, lane: Priority = NORMAL) -> Plan[None]:
        """Enqueue prepared requests on one shard's lane, all or none; raises QueueFull. Every request goes
        through here: the lane's request stream is the submit function's key."""
        stream = Keys(self.keys.namespace, shard).requests_in(lane)
        args = [self.max_unfinished, *(value for item in batch for value in (item.id, item.body))]
        for attempt in range(LOAD_TRIES):
            try:
                replicas = yield from self._write(library.SUBMIT, [stream], args)
                if self.wait_replicas and replicas < self.wait_replicas:
                    raise NotDurable(f"{len(batch)} requests enqueued on the primary, but {replicas} of "
                                     f"{self.wait_replicas} replicas confirmed them: submit them again under the same "
                                     f"ids", [item.id for item in batch], replicas, self.wait_replicas)
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

    def _write(self, name: str, keys: list[str], args: list[Any]) -> Plan[int]:
        """A function call that writes; in durable mode, how many replicas confirmed it (a WAIT after it in one
        pipeline on one Redis, on the primary of its keys' slot on Redis Cluster). A refusal is raised."""
        return (yield from written(fcall(name, keys, args), self.wait_replicas))[1]

    def fetch(self, request_id: str) -> Plan[Result | None]:
        """The result if it is there (non-blocking)."""
        if self.wait_replicas:
            found = (yield from self.present([request_id])).get(request_id)
            return self._checked(found) if found is not None else None
        found = first_result((yield command("XRANGE", self.keys.result(request_id), "-", "+", "COUNT", 1)),
                             request_id)
        return self._checked(found) if found is not None else None

    def wait_many(self, request_ids: Iterable[str], timeout: float | None, check: bool = True
                  ) -> Plan[dict[str, Result]]:
        """Results of all ``request_ids`` in their order; raises ResultTimeout naming how many are missing
        (early, after ``no_worker_s``, when no worker is alive). ``check``: each against what this producer
        last submitted under its id (else as stored)."""
        checked = self._checked if check else (lambda result: result)
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = list(dict.fromkeys(request_ids))
        done: dict[str, Result] = {}
        look, shortfall = waiting, None  # ids to look at, read again with a confirmation in durable mode
        liveness = Liveness(self.keys.namespace, self.no_worker_s, forever=timeout is None)
        while True:
            try:
                done.update((yield from self.present(look)))
                shortfall = None
            except NotDurable as error:  # durable mode: a result replicas have not confirmed is not there yet
                shortfall = error
            missing = [r for r in waiting if r not in done]
            left = None if deadline is None else deadline - time.monotonic()
            if not missing:
                break
            late = left is not None and left <= 0
            if liveness.due(late):
                liveness.looked((yield from self.live_workers()))
            gone = liveness.gone(late)
            if late or gone:
                raise shortfall or ResultTimeout(f"{len(missing)} of {len(waiting)} results not there yet"
                                                 f"{liveness.why() if gone else ''}",
                                                 {r: checked(result) for r, result in done.items()}, missing,
                                                 self.keys.namespace if gone else None)
            block = BLOCK_MS if left is None else max(1, min(BLOCK_MS, int(left * 1000)))
            window = {self.keys.result(r): r for r in missing[: 1 if self.cluster else WINDOW]}
            reply = yield xread(window, block)
            found, look = landed(reply, window, bool(self.wait_replicas))
            done.update(found)
            if self.cluster and reply:  # one key per read there: when the oldest lands, look at the rest (and, in
                look = missing if self.wait_replicas else missing[1:]  # durable mode, at it, confirmed)
        return {r: checked(done[r]) for r in waiting}

    def live_workers(self) -> Plan[int | None]:
        """Workers of this namespace whose heartbeat is younger than ``GONE_S`` (any shard); None when this
        user may not read the heartbeat hash (an aclfile older than the producer's read of it)."""
        try:
            beats = yield command("HGETALL", self.keys.workers())
        except redis.exceptions.NoPermissionError:
            return None
        now = time.time()
        return sum(1 for raw in beats.values() if beat_live(raw, now))

    def present(self, request_ids: list[str]) -> Plan[dict[str, Result]]:
        """The results already there, in one round trip (one key per command: fine on Redis Cluster too).
        Durable mode (a ``Durable`` batch that reads): confirmed by a replicated write after the reads, so that a
        result is returned only once the replicas asked for have it; NotDurable names those they lack. On Redis
        Cluster each primary's reads are confirmed apart, and only the ids on a primary whose replicas fell short
        are named."""
        if not request_ids:
            return {}
        reads = [command("XRANGE", self.keys.result(r), "-", "+", "COUNT", 1) for r in request_ids]
        if self.wait_replicas:
            sent = yield Durable(reads, self.wait_replicas, self.keys)
            for reply in sent.replies:
                if isinstance(reply, BaseException):
                    raise reply
            replies, counts = sent.replies, sent.replicas
        else:
            replies, counts = (yield Pipeline(reads)), [0] * len(request_ids)
        found = {r: result for r, reply in zip(request_ids, replies)
                 if (result := first_result(reply, r)) is not None}
        short = [(r, n) for r, n in zip(request_ids, counts) if r in found and n < self.wait_replicas]
        if short:
            fewest = min(n for _, n in short)
            raise NotDurable(f"{len(short)} results are on their primary, but {fewest} of {self.wait_replicas} "
                             f"replicas confirmed them: not returned yet", [r for r, _ in short], fewest,
                             self.wait_replicas)
        return found

    def decide(self, request: Submittable, timeout: float | None) -> Plan[Result]:
        """Submit, wait; a stored result of another request under the same id is answered ``id_conflict``."""
        prepared = prepare(request)
        [request_id] = yield from self.submit_many([prepared])
        # Checked against this call's own request, not the client's memory of the id: callers sharing a client
        # can submit under one id at once, and the memory holds the last of them.
        result = (yield from self.wait_many([request_id], timeout, check=False))[request_id]
        return prepared.answered_by(result)
