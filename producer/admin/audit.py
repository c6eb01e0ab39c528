"""The queue's invariant, checked from outside: every submitted request ends with exactly one result.

Used by the fault, bad-input and soak tests and by ``ops/soak.py`` against a real deployment. Given the ids
that were submitted, it reads every result stream and checks that each holds exactly one entry, that the entry
is a well-formed result for that id (``ok`` with answers, or ``error`` with a code and a message), and, when
the load is over, that nothing is half done: both lanes' request and part streams empty, no pending entries,
no parts or stored bodies of fanned-out requests left behind. Processing a prompt twice is allowed; publishing
twice is not.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError

from ..wire.keys import LANES, NORMAL, Field, Keys
from ..wire.result import Result

BATCH = 1000  # result streams read per pipelined round trip


@dataclass
class Report:
    """What the check found; ``problems()`` is empty when the invariant holds."""

    submitted: int = 0
    results: dict[str, Result] = field(default_factory=dict)  # id -> its one result
    missing: list[str] = field(default_factory=list)  # no result at all: lost (or not finished yet)
    duplicated: dict[str, int] = field(default_factory=dict)  # id -> result entries (> 1)
    malformed: dict[str, str] = field(default_factory=dict)  # id -> what is wrong with its result
    leftovers: dict[str, int] = field(default_factory=dict)  # what is not drained: name -> count

    @property
    def statuses(self) -> Counter[str]:
        """``ok`` and one key per error code, counted."""
        return Counter("ok" if r.ok else r.error.code.value for r in self.results.values())

    def problems(self, allow_missing: Iterable[str] = ()) -> list[str]:
        allowed = set(allow_missing)
        missing = [i for i in self.missing if i not in allowed]
        out = []
        if missing:
            out.append(f"{len(missing)} of {self.submitted} requests have no result (e.g. {missing[:5]})")
        if self.duplicated:
            some = dict(list(self.duplicated.items())[:5])
            out.append(f"{len(self.duplicated)} requests have several results: {some}")
        if self.malformed:
            out.append(f"{len(self.malformed)} malformed results: {dict(list(self.malformed.items())[:5])}")
        if self.leftovers:
            out.append(f"not drained: {self.leftovers}")
        return out

    def assert_ok(self, allow_missing: Iterable[str] = ()) -> Report:
        problems = self.problems(allow_missing)
        assert not problems, "; ".join(problems)
        return self

    def summary(self) -> str:
        return (f"{self.submitted} submitted, {len(self.results)} answered once ({dict(self.statuses)}), "
                f"{len(self.missing)} missing, {len(self.duplicated)} duplicated, {len(self.malformed)} malformed, "
                f"leftovers {self.leftovers or 'none'}")


def _read_results(connection: Any, keys: Keys, ids: list[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for start in range(0, len(ids), BATCH):
        batch = ids[start: start + BATCH]
        with connection.pipeline(transaction=False) as pipe:
            for request_id in batch:
                pipe.xrange(keys.result(request_id))
            out.update(zip(batch, pipe.execute()))
    return out


def _judge(request_id: str, entry_fields: dict[bytes, bytes]) -> tuple[Result | None, str | None]:
    try:
        result = Result.model_validate_json(entry_fields[Field.BODY.encode()])
    except (KeyError, ValidationError, ValueError) as error:
        return None, f"not a result: {str(error)[:200]}"
    if result.id != request_id:
        return None, f"result of {result.id!r} under {request_id!r}"
    if result.ok and not result.answers:
        return None, "ok without answers"
    if not result.ok and (result.error is None or not result.error.message):
        return None, "error without a code and a message"
    return result, None


def leftovers(connection: Any, keys: Keys, ids: Iterable[str] = (), shards: int = 1) -> dict[str, int]:
    """Work not finished or not cleaned up: stream entries, pending entries (every shard), parts and stored bodies."""
    out: dict[str, int] = {}
    for shard in range(max(1, shards)):
        shard_keys = Keys(keys.namespace, shard)
        for lane in LANES:
            for name, stream in (("requests", shard_keys.requests_in(lane)), ("chunks", shard_keys.parts_in(lane))):
                label = (name if lane == NORMAL else f"{lane} {name}") + ("" if shards <= 1 else f" s{shard}")
                length = connection.xlen(stream)
                if length:
                    out[f"{label} entries"] = length
                try:
                    pending = connection.xpending(stream, keys.group)["pending"]
                except redis.ResponseError:  # no stream or no group: nothing pending
                    pending = 0
                if pending:
                    out[f"{label} pending"] = pending
    ids = list(ids)
    for start in range(0, len(ids), BATCH):
        with connection.pipeline(transaction=False) as pipe:
            for request_id in ids[start: start + BATCH]:
                pipe.exists(keys.shares(request_id), keys.body(request_id))
            stale = sum(pipe.execute())
        if stale:
            out["parts or bodies"] = out.get("parts or bodies", 0) + stale
    return out


def check(connection: Any, keys: Keys, ids: Iterable[str], drained: bool = True, shards: int = 1) -> Report:
    """The invariant for ``ids`` now; ``drained=False`` skips the stream checks (other traffic on the queue)."""
    ids = list(dict.fromkeys(ids))
    report = Report(submitted=len(ids))
    for request_id, entries in _read_results(connection, keys, ids).items():
        if not entries:
            report.missing.append(request_id)
            continue
        if len(entries) > 1:
            report.duplicated[request_id] = len(entries)
        result, problem = _judge(request_id, entries[0][1])
        if problem:
            report.malformed[request_id] = problem
        elif result is not None:
            report.results[request_id] = result
    if drained:
        report.leftovers = leftovers(connection, keys, ids, shards)
    return report


def wait_and_check(connection: Any, keys: Keys, ids: Iterable[str], timeout: float = 120.0, drained: bool = True,
                           allow_missing: Iterable[str] = (), shards: int = 1, poll: float = 0.2) -> Report:
    """Wait (up to ``timeout``) until every id has a result and the queue has drained, then check.

    Polling is fine here: this is a checker, not a client. Only the ids still unanswered are read again while
    waiting; the final check reads them all. It returns the report either way, so a caller sees what was lost
    or duplicated rather than a bare timeout.
    """
    ids = list(dict.fromkeys(ids))
    allowed = set(allow_missing)
    deadline = time.monotonic() + timeout
    waiting = [i for i in ids if i not in allowed]
    while time.monotonic() < deadline:
        found = _read_results(connection, keys, waiting)
        waiting = [i for i in waiting if not found[i]]
        if not waiting and not (drained and leftovers(connection, keys, (), shards)):
            break
        time.sleep(poll)
    return check(connection, keys, ids, drained, shards)
