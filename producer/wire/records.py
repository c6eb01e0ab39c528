"""A request's record, and what status and cancel say from it (docs/PROTOCOL.md, "Status" and "Cancelling").

The record (``Keys.record``, a hash of ``Record`` fields) is what the queue knows of a request besides its
payload: its lane and entry (written by the submit function), the worker that took it and since when (written
by that worker at its take: once the entry is planned, in the round trip that looks up the id's stored
result), that it fanned out, that a cancel came, and at last how it was answered (written by the worker that
acknowledges it, and kept from then on as long as the result: the worker's ``--record-ttl-s``, at most and by
default its ``--result-ttl-s``; it was kept a day past the result, whatever that TTL). While its request is
unanswered a record is kept ``RECORD_TTL_S``: those are as many as the streams' entries, bounded by the queue's
own limit, and one whose entry was trimmed or deleted unanswered goes then. It lives in its shard's slot, so
the functions that write it run on the node of the shard's streams (docs/PROTOCOL.md, "Records and the
shard's slot", says why they stay there), and it holds no payload: the monitor role may read it.

A request sent again under an id whose earlier request was cancelled and is not answered yet keeps the cancel
mark (revision 5): the earlier entry is answered ``cancelled``, and so is the new one (an id has one result),
so its status says ``cancelled``, not ``queued`` with no mark. Only an answered request's mark is cleared: a
request sent under its id once the result is gone is another request.

Every check for a cancel rides a call a worker makes anyway: its take reads the cancel mark in the round trip
that looks up the id's stored result (a part's, in the one that reads its stored body), and each worker reads
its shard's cancel notices (``Keys.cancels``) as they come, to drop what it holds and has not packed yet. The
cancel function decides by where the entry is, atomically with deliveries: not delivered yet, it is never
computed (whoever reads it finds the mark at its take); delivered, its worker decides (against its packer).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .keys import GROUP, LANES, PROTOCOL, Field, Record, RecordState

RECORD_TTL_S = 7 * 86400  # a record while its request waits unanswered (one trimmed away is not kept forever)
CANCELS_CAP = 100_000  # notices a shard's cancel stream keeps (approximately): workers read them as they come
FOUND = ("queued", "held", "answered", "unknown")  # what a cancel found, counted per shard (Keys.cancel_counts)
ID_CHARS = "^[A-Za-z0-9._:%-]+$"  # a request id's characters, as a Lua pattern (keys.ID_PATTERN)

# The Lua of the record's functions, part of the library (producer/wire/library.py puts it after STREAMS and
# before ``submit``, which writes records); {{ and }} are Lua's braces.
LUA = f"""
local RECORD_TTL = {RECORD_TTL_S}
local CANCELS_CAP = {CANCELS_CAP}
local LANE_NAMES = {{{", ".join(repr(str(lane)) for lane in LANES)}}}
local CANCELS_KEY = '^(.+:v{PROTOCOL}:{{s%d+}}:)cancels$'

local function request_stream(key)  -- the lane of a request stream (LANE_NAMES, as STREAMS), or nil
  for lane, pattern in ipairs(STREAMS) do
    if string.match(key, pattern) then return LANE_NAMES[lane] end
  end
end

-- The records of the entries a submit call just added (its ARGV: limit, then id and body per entry; revision 4):
-- best effort (pcall), so that a producer whose ACL user predates records still enqueues (status and cancel then do
-- not know its requests). Position: the stream's entries added up to this one, from the group's read count and lag
-- (-1: unknown, without a valid lag).
local function record_queued(stream, lane, length, args, entries)
  local prefix = string.match(stream, '^(.+:{{s%d+}}:)')
  local added = length  -- before these; no group yet: nothing was read or deleted, every entry added is still there
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if groups.err then added = nil else
    for _, group in ipairs(groups) do
      local info = {{}}
      for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
      if info['name'] == '{GROUP}' then
        added = (info['entries-read'] and info['lag']) and info['entries-read'] + info['lag'] - #entries or nil
      end
    end
  end
  for i, entry in ipairs(entries) do
    local key = prefix .. 'record:' .. (args[2 * i] ~= '' and args[2 * i] or entry)
    -- An earlier request's record under this id: its cancel mark kept unless it was answered (revision 5): a request
    -- cancelled and not answered yet is answered `cancelled`, and so is one sent again under its id.
    local earlier, mark = redis.pcall('HMGET', key, '{Record.STATE}', '{Record.CANCELLED}'), ''
    if type(earlier) == 'table' and earlier[1] and earlier[1] ~= '{RecordState.ANSWERED}' and earlier[2] then
      mark = earlier[2]
    end
    redis.pcall('HSET', key, '{Record.STATE}', '{RecordState.QUEUED}', '{Record.LANE}', lane,
                '{Record.STREAM}', stream, '{Record.ENTRY}', entry, '{Record.POSITION}', added and added + i or -1,
                '{Record.CANCELLED}', mark)
    redis.pcall('EXPIRE', key, RECORD_TTL)
  end
end

-- Where a request's entry is for the workers, from the stream's group: 'held' (delivered, not acknowledged: its worker
-- decides), 'queued' (not delivered yet: whoever reads it finds the cancel before planning is done) or 'read'
-- (delivered and acknowledged: answered, or being answered). ``groups`` caches each stream's last delivered id.
local function whereabouts(stream, entry, groups)
  local pending = redis.pcall('XPENDING', stream, '{GROUP}', entry, entry, 1)
  if pending.err then return 'queued', '' end  -- no group yet: nobody read anything
  if pending[1] then return 'held', pending[1][2] end
  if groups[stream] == nil then
    groups[stream] = '0-0'
    for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {{}}
      for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
      if info['name'] == '{GROUP}' then groups[stream] = info['last-delivered-id'] end
    end
  end
  local ms, seq = string.match(entry, '^(%d+)%-(%d+)$')
  local last_ms, last_seq = string.match(groups[stream], '^(%d+)%-(%d+)$')
  if not ms or not last_ms then return 'read', '' end
  ms, seq, last_ms, last_seq = tonumber(ms), tonumber(seq), tonumber(last_ms), tonumber(last_seq)
  if ms > last_ms or (ms == last_ms and seq > last_seq) then return 'queued', '' end
  return 'read', ''
end

-- Cancel (revision 4). KEYS: a shard's cancel stream, its counts, then each request's record in that shard. ARGV: the
-- time (ms), then each request's id. Per id: {{'cancelled'}} (not delivered yet: never computed, answered `cancelled`
-- by the worker that reads it), {{'cancelling', worker}} (delivered, or fanned out: answered `cancelled` unless a
-- prompt of it is packed, its worker decides), {{'answered', status, code}} or {{'unknown'}}. A request's first cancel
-- marks its record and adds a notice. Atomic with a delivery (XREADGROUP): a request not yet delivered is read later,
-- by a worker that checks the mark before its prompts go to the packer.
local function cancel(keys, args)
  local base = string.match(keys[1] or '', CANCELS_KEY)
  if not base or keys[2] ~= base .. 'cancels:counts' or #args < 2 or #keys ~= #args + 1
      or #args > MAX_BATCH + 1 or not tonumber(args[1]) then
    return redis.error_reply('INVALID expected a cancel stream, its counts and records; the time, ids (1 to ' ..
      MAX_BATCH .. ')')
  end
  for i = 2, #args do
    if #args[i] > 128 or not string.match(args[i], '{ID_CHARS}') or keys[i + 1] ~= base .. 'record:' .. args[i] then
      return redis.error_reply('INVALID id ' .. (i - 1) .. ' is not a request id of this record key')
    end
  end
  local out, counts, groups = {{}}, {{}}, {{}}
  for i = 2, #args do
    local key, found = keys[i + 1], 'unknown'
    local r = redis.call('HMGET', key, '{Record.STATE}', '{Record.CANCELLED}', '{Record.STATUS}', '{Record.CODE}',
                         '{Record.STREAM}', '{Record.ENTRY}')
    if not r[1] and not r[6] then out[i - 1] = {{'unknown'}}
    elseif r[1] == '{RecordState.ANSWERED}' then
      found, out[i - 1] = 'answered', {{'answered', r[3] or '', r[4] or ''}}
    else
      if not r[2] or r[2] == '' then
        redis.call('HSET', key, '{Record.CANCELLED}', args[1])
        redis.call('XADD', keys[1], 'MAXLEN', '~', CANCELS_CAP, '*', '{Field.REQUEST_ID}', args[i],
                   '{Field.STREAM}', r[5] or '', '{Field.ENTRY_ID}', r[6] or '')
      end
      local where, worker = 'read', ''
      if r[1] ~= '{RecordState.FANNED_OUT}' and r[5] and r[6] and request_stream(r[5])
          and string.sub(r[5], 1, #base) == base then
        where, worker = whereabouts(r[5], r[6], groups)
      end
      if where == 'queued' then found, out[i - 1] = 'queued', {{'cancelled'}}
      else found, out[i - 1] = 'held', {{'cancelling', worker}} end
    end
    counts[found] = (counts[found] or 0) + 1
  end
  for _, found in ipairs({{{", ".join(repr(found) for found in FOUND)}}}) do
    if counts[found] then redis.call('HINCRBY', keys[2], found, counts[found]) end
  end
  return out
end
"""


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # open, as results are: later versions may add fields


class Cancel(_Answer):
    """What a cancel did for one id. ``state``: ``cancelled`` (not delivered to a worker yet: never computed,
    answered `cancelled` when a worker reads it; or it is answered `cancelled` already), ``cancelling`` (a
    worker holds it, ``worker``: answered `cancelled` unless a prompt of it is already packed, then answered
    normally; read its result to know), ``too_late`` (already answered: ``status`` and ``code`` say how) or
    ``unknown`` (no record: never sent through the submit function, or answered long ago). Cancelling again
    answers the same; nothing is undone."""

    id: str
    state: Literal["cancelled", "cancelling", "too_late", "unknown"]
    worker: str | None = None
    status: str | None = None
    code: str | None = None


def cancel_of(request_id: str, reply: list[Any]) -> Cancel:
    """One id's answer of the cancel function."""
    words = [value.decode() if isinstance(value, bytes) else str(value) for value in reply]
    if words[0] == "answered":  # by its own cancel (a second cancel), or too late for this one
        return Cancel(id=request_id, state="cancelled" if words[2] == "cancelled" else "too_late",
                      status=words[1] or None, code=words[2] or None)
    if words[0] == "cancelling":
        return Cancel(id=request_id, state="cancelling", worker=words[1] or None)
    return Cancel(id=request_id, state="cancelled" if words[0] == "cancelled" else "unknown")


class Status(_Answer):
    """Where a request is. ``state``:

    - ``queued``: in its ``lane``'s stream, no worker has it; ``ahead``: entries before it not yet read (when known)
    - ``in_progress``: ``worker`` holds it since ``since_ms`` (once planned), delivered ``deliveries`` times;
      or, fanned out, ``parts_done`` of its ``parts`` are answered
    - ``answered`` (``status`` ok or error, ``code``, ``answered_ms``), ``cancelled``, ``dead_lettered``: its
      result was published (``expired``: and has expired since); ``cancelled`` also for a queued request whose
      cancel came (answered when a worker reaches it)
    - ``unknown``: ``detail`` says what can be told: never sent (through the submit function) or answered and
      long expired, which look alike; or sent and its entry gone unanswered (deleted or trimmed).

    ``cancel_requested_ms``: when a cancel came, whatever the state (an answered request's cancel came too late)."""

    id: str
    state: Literal["queued", "in_progress", "answered", "cancelled", "dead_lettered", "unknown"]
    lane: str | None = None
    ahead: int | None = None
    worker: str | None = None
    since_ms: int | None = None
    deliveries: int | None = None
    parts: int | None = None
    parts_done: int | None = None
    status: str | None = None
    code: str | None = None
    answered_ms: int | None = None
    expired: bool | None = None
    cancel_requested_ms: int | None = None
    detail: str | None = None


def _int(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number >= 0 else None


def entry_order(entry_id: str) -> tuple[int, int]:
    millis, _, sequence = entry_id.partition("-")
    return int(millis or 0), int(sequence or 0)


def status_of(request_id: str, record: dict[str, str], result: bool, pending: dict[str, Any] | None = None,
              group: dict[str, Any] | None = None, parts_done: int | None = None) -> Status:
    """A request's status from its record (decoded, empty: none), whether its result stream exists, its
    entry's pending-list entry (XPENDING: consumer, deliveries; None: not pending), its stream's worker group
    (XINFO GROUPS: last-delivered-id, entries-read; None: no group) and, fanned out, how many parts are
    answered."""
    cancel = {"cancel_requested_ms": _int(record.get(Record.CANCELLED))}
    state, lane = record.get(Record.STATE), record.get(Record.LANE)
    if state == RecordState.ANSWERED or (not record and result):
        code = record.get(Record.CODE) or None
        named = code if code in ("cancelled", "dead_lettered") else "answered"
        return Status(id=request_id, state=named, lane=lane, status=record.get(Record.STATUS), code=code,  # type: ignore[arg-type]
                      answered_ms=_int(record.get(Record.AT)), expired=not result or None, **cancel)
    if not record:
        return Status(id=request_id, state="unknown", detail="no record and no result: never sent through the submit "
                      "function, or answered and expired long ago (these look alike)")
    if result:  # published, its record not updated yet (its worker acknowledges it next): how, the result says
        return Status(id=request_id, state="answered", lane=lane, **cancel)
    if state == RecordState.FANNED_OUT:
        return Status(id=request_id, state="in_progress", lane=lane, parts=_int(record.get(Record.PARTS)),
                      parts_done=parts_done, since_ms=_int(record.get(Record.SINCE)), **cancel)
    if pending is not None:
        consumer = pending["consumer"]
        since = _int(record.get(Record.SINCE)) if record.get(Record.CONSUMER) == consumer else None
        return Status(id=request_id, state="in_progress", lane=lane, worker=consumer, since_ms=since,
                      deliveries=pending["deliveries"], **cancel)
    entry = record.get(Record.ENTRY, "")
    last = (group or {}).get("last-delivered-id")
    if group is None or entry_order(entry) > entry_order(str(last or "0-0")):  # not read by the workers yet
        if cancel["cancel_requested_ms"] is not None:
            return Status(id=request_id, state="cancelled", lane=lane, **cancel)
        position, read = _int(record.get(Record.POSITION)), 0 if group is None else _int(group.get("entries-read"))
        ahead = None if position is None or read is None else max(0, position - 1 - read)
        return Status(id=request_id, state="queued", lane=lane, ahead=ahead, **cancel)
    return Status(id=request_id, state="unknown", lane=lane, detail=f"sent (entry {entry} of "
                  f"{record.get(Record.STREAM)}), but its entry is gone and it has no result: deleted or trimmed "
                  "unanswered", **cancel)
