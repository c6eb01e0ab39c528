"""Every Redis name that producers and workers share, in one place (wire protocol v1): keys, and the fields of
stream entries.

Each shard has two lanes, ``high`` and ``normal``, each with its own request and part streams: a worker reads
the high lane's streams apart from the normal lane's, so a high request never waits behind normal entries
already read. The stream an entry is in is its lane (docs/PROTOCOL.md, "Priority lanes").

Streams carry a shard hash tag (``{s0}``) so that a worker's blocking read over its shard's request and part
streams touches one Redis Cluster slot. Per-request keys carry the request id as their hash tag, so the Lua
scripts that aggregate and publish a request's result touch one slot whatever the shard.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

PROTOCOL = "1"
GROUP = "workers"
# Request ids become hash tags and key suffixes: no braces, no spaces, no newline, bounded length. Anchored
# with \A and \Z (``$`` would let a trailing newline through); use ``valid_id``, which also refuses entry-id
# shapes.
ID_PATTERN = re.compile(r"\A[A-Za-z0-9._:\-]{1,128}\Z")
# A stream entry id: the id of a request sent without one. Reserved: a custom id of this shape could be chosen
# to match a later request's entry id, and that request would be answered with the first one's result.
ENTRY_ID_SHAPE = re.compile(r"\A[0-9]+-[0-9]+\Z")
# A reply stream: a namespace's reply prefix, then a suffix of the id alphabet (no braces: no hash tags).
REPLY_SUFFIX = re.compile(r"\A[A-Za-z0-9._:\-]{1,128}\Z")
# Its shape whatever the namespace (the wire schema's check; a worker also wants its own namespace's prefix).
REPLY_STREAM = re.compile(r"\A[A-Za-z0-9._:\-]{1,64}:v" + PROTOCOL + r":reply:[A-Za-z0-9._:\-]{1,128}\Z")
# A namespace, the prefix of every name of a deployment: no braces (hash tags), no colons (the worker's rule).
NAMESPACE_PATTERN = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")
ANY = "*"  # as a shard or a request id, makes a Keys name a glob pattern (ACL rules); never a valid id
MAX_BODY_BYTES = 8 << 20  # a request body's largest size: the submit function's cap, the worker's default one
# A served model's name (``dq-worker serve --served-model-name``; the ``model`` of a System One call): what a
# result says answered it, what a heartbeat lists and what the gateway routes by. Hub-style names
# (``org/name``) and versions (``jev-1.14.0``) fit; spaces, quotes and braces do not.
MODEL_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}\Z")
# A worker whose heartbeat (Keys.workers) is this old, or a group consumer idle this long with nothing
# pending, is gone: stats do not count it. Workers beat every 5 s; clocks are assumed in sync (NTP).
GONE_S = 30


class Priority(enum.StrEnum):
    """The lanes of a shard (the request field ``priority``; a metric label)."""

    HIGH = "high"
    NORMAL = "normal"


HIGH, NORMAL = Priority.HIGH, Priority.NORMAL
LANES = (HIGH, NORMAL)  # the order workers serve them in


class Field:
    """Field names of stream entries (an entry is a flat map: ``XADD key * field value ...``)."""

    BODY = "body"  # request entries: the request JSON; result and reply entries: the result JSON
    PUBLISHER = "publisher"  # result entries: the worker's delivery that published it (stream key, entry id, count)
    REPLY_ID = "id"  # reply entries: the request the result answers (one reply stream serves many requests)
    # Part entries: one part of a fanned-out request, whose body is stored at Keys.body(request_id)
    REQUEST_ID = "request_id"
    PART = "part"  # this part's index, from 0
    PARTS = "parts"  # how many parts the request has
    QUESTIONS = "questions"  # JSON list of this part's question names
    ENQUEUED_MS = "enqueued_ms"  # when the request was enqueued (ms): its entry id's time
    TRACEPARENT = "traceparent"  # the request's W3C trace context, when it has one (for the worker's logs)
    # Dead-letter entries: where the entry was and why it was given up, then the entry's own fields
    STREAM = "stream"  # requests or chunks (the part stream)
    ENTRY_ID = "entry_id"
    DELIVERIES = "deliveries"
    REASON = "reason"
    LANE = "lane"  # high or normal: the lane of the stream the entry was in
    # Cancel notices (Keys.cancels): REQUEST_ID, and STREAM and ENTRY_ID of its request entry as its record says


class Record:
    """Fields of a request's record (``Keys.record``, a hash): what the queue knows of a request besides its
    payload, for status and cancel (producer/wire/records.py)."""

    STATE = "state"  # RecordState
    LANE = "lane"  # high or normal
    STREAM = "stream"  # the request stream its entry is in, and the entry's id
    ENTRY = "entry"
    POSITION = "position"  # entries added to that stream up to this one (how many are ahead), when known
    CONSUMER = "consumer"  # the worker that took it (its consumer name), since when (ms): written at its take
    SINCE = "since"
    PARTS = "parts"  # fanned out: into how many parts
    CANCELLED = "cancelled"  # when a cancel came (ms)
    STATUS = "status"  # answered: ok or error, the error's code, when (ms)
    CODE = "code"
    AT = "at"


class RecordState(enum.StrEnum):
    """Where a request is, as its record says (``Record.STATE``)."""

    QUEUED = "queued"  # enqueued by the submit function (where its entry is, the stream's group says)
    FANNED_OUT = "fanned_out"  # its parts are in the part stream
    ANSWERED = "answered"  # its result is published (the record kept as long as the result)


@dataclass(frozen=True)
class Keys:
    """The names of one deployment (``namespace``) and one stream shard. With ``ANY`` for the shard or a
    request id, the same names are glob patterns (``Keys(ns, ANY).requests``: every shard's request
    stream)."""

    namespace: str = "dq"
    shard: int | str = 0

    @property
    def base(self) -> str:
        return f"{self.namespace}:v{PROTOCOL}"

    @property
    def requests(self) -> str:
        """Stream of the normal lane's request entries (field ``body``: the request JSON)."""
        return self.requests_in(NORMAL)

    @property
    def parts(self) -> str:
        """The normal lane's stream of the parts of over-length requests, fanned out so that any worker takes any."""
        return self.parts_in(NORMAL)

    def requests_in(self, lane: Priority) -> str:
        """A lane's request stream: ``...:requests`` (normal, the protocol's first stream) or ``...:requests:high``."""
        return f"{self.base}:{{s{self.shard}}}:requests" + ("" if lane == NORMAL else f":{Priority(lane)}")

    def parts_in(self, lane: Priority) -> str:
        """A lane's part stream: the parts of a request stay in its lane."""
        return f"{self.base}:{{s{self.shard}}}:chunks" + ("" if lane == NORMAL else f":{Priority(lane)}")

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that were delivered too often, with the reason."""
        return f"{self.base}:{{s{self.shard}}}:dead"

    @property
    def group(self) -> str:
        return GROUP

    @property
    def reply_prefix(self) -> str:
        """Reply streams named by producers must start with this (workers write nowhere else)."""
        return f"{self.base}:reply:"

    def is_reply_stream(self, name: object) -> bool:
        """``name`` is one of this deployment's reply streams: exactly its prefix, then a suffix of 1-128
        characters of A-Z a-z 0-9 . _ : - (so never another request's key, nor another namespace's)."""
        return (isinstance(name, str) and name.startswith(self.reply_prefix)
                and bool(REPLY_SUFFIX.match(name[len(self.reply_prefix):])))

    def result(self, request_id: str) -> str:
        """Stream holding the one result entry of a request (readable again until its TTL expires)."""
        return f"{self.base}:result:{{{request_id}}}"

    def shares(self, request_id: str) -> str:
        """Hash of the finished parts of a fanned-out request: part index -> part result JSON."""
        return f"{self.base}:parts:{{{request_id}}}"

    def body(self, request_id: str) -> str:
        """The request JSON of a fanned-out request, read by whichever worker takes one of its parts."""
        return f"{self.base}:body:{{{request_id}}}"

    def record(self, request_id: str) -> str:
        """Hash of what the queue knows of a request (``Record``), in its shard's slot: written by the submit
        function, the workers and cancels, each in a call on the shard's streams
        (producer/wire/records.py)."""
        return f"{self.base}:{{s{self.shard}}}:record:{request_id}"

    @property
    def cancels(self) -> str:
        """Stream of cancel notices (request id, its entry) that every worker of the shard reads: a worker
        holding a cancelled request drops it if none of its prompts is packed yet."""
        return f"{self.base}:{{s{self.shard}}}:cancels"

    @property
    def cancel_counts(self) -> str:
        """Hash of cancels asked, by what each found (``records.FOUND``): the queue exporter's counters."""
        return f"{self.base}:{{s{self.shard}}}:cancels:counts"

    def durable(self) -> str:
        """A Pub/Sub channel nobody reads: a durable-mode reader publishes an empty message to it so that its
        WAIT covers what it read (WAIT counts a connection's own writes, and the replication stream is one
        order)."""
        return f"{self.base}:durable"

    def durable_mark(self, beside: str) -> str:
        """A key in the slot of ``beside`` (a key with a hash tag), set for a few seconds by a durable-mode
        reader on Redis Cluster after its reads there: there PUBLISH is not replicated, a SET is, and its WAIT
        covers what was read before it (producer/plumbing/cluster_wait.py)."""
        return f"{self.base}:durable:{{{hash_tag(beside)}}}"

    def workers(self) -> str:
        """Hash of workers: consumer name -> JSON heartbeat ``{ts, inflight, model, models, engine, shard,
        state}``, written every 5 s (worker/loop/presence.py); beats older than GONE_S are gone and deleted by
        the live workers. ``model``: the name its results say; ``models``: every name it serves under, that
        one first (``beat_models``)."""
        return f"{self.base}:workers"

    def call(self, digest: str) -> str:
        """A System One call's request id (``SET NX`` with a TTL): a client's retries of one call, whichever
        gateway replica they reach, map to one request (producer/gateway/systemone/retries.py). ``digest``:
        hex of the caller's tenant, the model and the request (or its ``Idempotency-Key``)."""
        return f"{self.base}:call:{{{digest}}}"

    @property
    def everything(self) -> str:
        """Glob pattern of every key of the deployment (ACL rules)."""
        return f"{self.base}:{ANY}"


def valid_id(value: object) -> bool:
    """A custom request id: ``ID_PATTERN``, and not shaped like a stream entry id (those are reserved)."""
    return isinstance(value, str) and bool(ID_PATTERN.match(value)) and not ENTRY_ID_SHAPE.match(value)


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: the text between its first ``{`` and the next ``}`` when not
    empty, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1: end] if end > start + 1 else key


def shard_of(request_id: str, shards: int) -> int:
    """The stream shard a producer sends a request to when a deployment runs several (stable across processes)."""
    if shards <= 1:
        return 0
    value = 0
    for byte in request_id.encode():
        value = (value * 31 + byte) & 0xFFFFFFFF
    return value % shards


def text(value: Any) -> str:
    """A name or value as Redis answers it (bytes, unless the client decodes) as text; bytes that are not
    UTF-8 are replaced, never raised on: stream names and consumer names come from anyone who can write."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def beat_models(raw: Any) -> tuple[str, ...]:
    """The names a worker's heartbeat says it serves, the one its results say first (a heartbeat of a worker
    older than served names has ``model`` alone); names that are not MODEL_NAME are left out, an unreadable
    beat has none."""
    try:
        beat = json.loads(raw)
        names = beat.get("models") or [beat.get("model")]
    except (ValueError, TypeError, AttributeError):
        return ()
    if not isinstance(names, list):
        return ()
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and MODEL_NAME.match(n)))


def beat_age(raw: Any, now: float) -> float:
    """Seconds since a worker wrote a heartbeat of ``Keys.workers`` (``{"ts": ...}``; unreadable: infinitely old)."""
    try:
        return now - float(json.loads(raw)["ts"])
    except (ValueError, TypeError, KeyError):
        return float("inf")


def beat_live(raw: Any, now: float) -> bool:
    """Whether the worker that wrote a heartbeat of ``Keys.workers`` is alive: its beat younger than ``GONE_S``."""
    return beat_age(raw, now) < GONE_S
