"""The queue's server-side code: one Redis Function library, ``dq_v1``, and how it gets onto a server.

Every script the protocol runs inside Redis is here, so that no role needs ``EVAL``, ``EVALSHA`` or ``SCRIPT``:
producers call ``dq_v1_submit`` (admission: the request stream, each id, each body's size, backpressure, then one
``XADD`` per request, all or nothing), workers ``dq_v1_publish`` and ``dq_v1_part`` (the exactly-once result) and
``dq_v1_forget`` (consumers of workers that are gone); since revision 2 ``dq_v1_publish_as``, ``dq_v1_part_as``
and ``dq_v1_reply`` (publication that knows who made it, with its reply), and either lane's request stream; since
revision 4 each request's record (records.py: ``dq_v1_submit`` writes it, ``dq_v1_cancel`` marks it).
A leaked credential can call these functions, never run Lua of its own. Redis checks every command a function
runs against its *caller's* ACL user, so a function never gives a caller more than the caller's user holds.

Loading (``FUNCTION LOAD``) is an admin's act (``dq-worker load-functions``), or the worker's where its user may:
functions persist in RDB/AOF and replicate, but a server restarted empty has none. ``ensure`` loads the library
when it is missing, and replaces an older revision when asked. The library name carries the protocol version: a
v2 loads beside v1 during a rolling upgrade. Within v1 a new ``REVISION`` keeps every function's arguments and
meaning (it may add functions or optional trailing arguments), so old and new workers share it; the newest
revision wins and nothing loads an older one over a newer.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import redis

from .errors import LibraryUnavailable
from .keys import LANES, MAX_BODY_BYTES, PROTOCOL, Field, Keys
from .records import LUA as RECORDS

LIBRARY = f"dq_v{PROTOCOL}"
SUBMIT = f"{LIBRARY}_submit"  # KEYS: a request stream. ARGV: limit (0: none), then id, body per request
# Revision 1's publication, no current worker's: kept for a rolling upgrade (a revision keeps every function).
PUBLISH = f"{LIBRARY}_publish"  # KEYS: result, parts, body. ARGV: result JSON, TTL s. 1 published now, 0 already
PART = f"{LIBRARY}_part"  # KEYS: parts, result. ARGV: index, count, part JSON, TTL s. -1 done, 0 wait, else all
# Revision 2: publication that records and tells who published (so that a call re-sent after its answer was lost
# knows it published), adds the reply in the same call on one server, and clears what a request reusing a published
# id left; and the reply alone (Redis Cluster, where a reply stream has its own slot). Answers: see the Lua below.
# Revision 3: a reply stream's length capped (an optional last argument of publish_as and reply).
PUBLISH_AS = f"{LIBRARY}_publish_as"  # KEYS: result, parts, body[, reply]. ARGV: JSON, TTL s, publisher[, id, cap]
PART_AS = f"{LIBRARY}_part_as"  # KEYS: result, parts, body. ARGV: index, count, part JSON, TTL s
REPLY = f"{LIBRARY}_reply"  # KEYS: a reply stream. ARGV: request id, result JSON, TTL s[, cap]. 1, or an error
FORGET = f"{LIBRARY}_forget"  # KEYS: a work stream. ARGV: group, idle limit ms, own consumer name. Names deleted
REVISION_FUNCTION = f"{LIBRARY}_revision"  # no keys: this library's REVISION
CANCEL = f"{LIBRARY}_cancel"  # revision 4. KEYS: cancel stream, counts, records. ARGV: ms, ids. An answer per id
REVISION = 4  # bumped on every change of CODE (tests/unit/test_library_code.py pins each revision's hash)
MAX_BATCH = 1000  # requests per submit call: bounds the time Redis spends in one call


def _stream_pattern(template: str) -> str:
    """A Lua pattern of a request stream (its name with namespace ``\0`` and shard ``\1``), any namespace, shard."""
    escaped = re.sub(r"([\^$()%.\[\]*+\-?])", r"%\1", template)
    return "^" + escaped.replace("\0", ".+").replace("\1", "%d+") + "$"


# Streams the submit function writes to, each lane's request stream: producers reach no other key through it.
SUBMIT_STREAMS = tuple(Keys("\0", "\1").requests_in(lane) for lane in LANES)

# The Lua text is part of the wire (its digest is pinned per revision).
CODE = f"""#!lua name={LIBRARY}
-- decision-queue, wire protocol v{PROTOCOL}, revision {REVISION} (producer/wire/library.py, records.py)
local REVISION = {REVISION}
local MAX_BODY = {MAX_BODY_BYTES}
local MAX_BATCH = {MAX_BATCH}
local STREAMS = {{{", ".join(repr(_stream_pattern(template)) for template in SUBMIT_STREAMS)}}}
{RECORDS}
-- A request id: empty (the entry id is the request id), or 1-128 of A-Z a-z 0-9 . _ : - and not shaped like a
-- stream entry id (which requests without an id are answered under).
local function valid_id(id)
  if id == '' then return true end
  if #id > 128 or not string.match(id, '^[A-Za-z0-9._:%-]+$') then return false end
  return not string.match(id, '^%d+%-%d+$')
end

local function submit(keys, args)
  local stream = keys[1]
  local lane = #keys == 1 and request_stream(stream)
  if not lane then return redis.error_reply('INVALID the key is not a request stream') end
  local limit = tonumber(args[1])
  local count = (#args - 1) / 2
  if not limit or limit < 0 or count < 1 or count % 1 ~= 0 or count > MAX_BATCH then
    return redis.error_reply('INVALID expected: limit, then id and body of 1 to ' .. MAX_BATCH .. ' requests')
  end
  for i = 1, count do
    if not valid_id(args[2 * i]) then
      return redis.error_reply('INVALID request ' .. i .. ': the id must be 1-128 characters of ' ..
        'A-Z a-z 0-9 . _ : - and not shaped like a stream entry id')
    end
    local size = #args[2 * i + 1]
    if size == 0 or size > MAX_BODY then
      return redis.error_reply('INVALID request ' .. i .. ': the body is ' .. size .. ' bytes, not 1 to ' .. MAX_BODY)
    end
  end
  local length = redis.call('XLEN', stream)
  if limit > 0 and length + count > limit then
    return redis.error_reply('QUEUEFULL ' .. length .. ' unfinished entries, limit ' .. limit)
  end
  local entries = {{}}
  for i = 1, count do entries[i] = redis.call('XADD', stream, '*', '{Field.BODY}', args[2 * i + 1]) end
  record_queued(stream, lane, length, args, entries)
  return entries
end

local function publish(keys, args)
  if redis.call('EXISTS', keys[1]) == 1 then return 0 end
  redis.call('XADD', keys[1], '*', '{Field.BODY}', args[1])
  redis.call('EXPIRE', keys[1], args[2])
  redis.call('DEL', keys[2], keys[3])
  return 1
end

local function part(keys, args)
  if redis.call('EXISTS', keys[2]) == 1 then return -1 end
  redis.call('HSET', keys[1], args[1], args[3])
  redis.call('EXPIRE', keys[1], args[4])
  if redis.call('HLEN', keys[1]) < tonumber(args[2]) then return 0 end
  return redis.call('HGETALL', keys[1])
end

-- The value of a field in a flat [name, value, ...] array (an entry's fields), or ''.
local function field(fields, name)
  for i = 1, #fields, 2 do if fields[i] == name then return fields[i + 1] end end
  return ''
end

-- Once a request has its result: {{'published', who published it, the result JSON}}. What a request that reused a
-- published id left (a stored body, parts) is garbage: deleted. KEYS: result, parts, body.
local function stored(keys)
  local first = redis.call('XRANGE', keys[1], '-', '+', 'COUNT', 1)[1]
  if not first then return nil end
  redis.call('DEL', keys[2], keys[3])
  return {{'published', field(first[2], '{Field.PUBLISHER}'), field(first[2], '{Field.BODY}')}}
end

-- Add a reply, refreshing the stream's TTL: 1, or why Redis refused (a key of another type is left untouched, no
-- entry and no TTL; an ACL). Never raises: a reply must not undo what the call did before it. ``cap`` (revision 3,
-- optional): the stream keeps about that many newest replies (approximate MAXLEN: trimmed a node at a time).
local function add_reply(key, id, body, ttl, cap)
  local kind = redis.pcall('TYPE', key)
  if kind.err then return kind.err end
  if kind.ok ~= 'stream' and kind.ok ~= 'none' then return 'WRONGTYPE the reply stream is a ' .. kind.ok end
  local added
  if tonumber(cap) then
    added = redis.pcall('XADD', key, 'MAXLEN', '~', cap, '*', '{Field.REPLY_ID}', id, '{Field.BODY}', body)
  else
    added = redis.pcall('XADD', key, '*', '{Field.REPLY_ID}', id, '{Field.BODY}', body)
  end
  if type(added) == 'table' and added.err then return added.err end
  redis.pcall('EXPIRE', key, ttl)
  return 1
end

-- The first publication wins and records its publisher (the worker's delivery); with a reply stream (one server),
-- the reply is added here, exactly once with it: {{'published', publisher, '', 1 or why the reply was refused}}.
-- Already published: as ``stored``.
local function publish_as(keys, args)
  local found = stored(keys)
  if found then return found end
  redis.call('XADD', keys[1], '*', '{Field.BODY}', args[1], '{Field.PUBLISHER}', args[3])
  redis.call('EXPIRE', keys[1], args[2])
  redis.call('DEL', keys[2], keys[3])
  local replied = 0
  if keys[4] then replied = add_reply(keys[4], args[4], args[1], args[2], args[5]) end
  return {{'published', args[3], '', replied}}
end

-- A part's share: 0 while parts are missing, every part (as HGETALL gives them) once all are in; as ``stored``
-- when the request has its result.
local function part_as(keys, args)
  local found = stored(keys)
  if found then return found end
  redis.call('HSET', keys[2], args[1], args[3])
  redis.call('EXPIRE', keys[2], args[4])
  if redis.call('HLEN', keys[2]) < tonumber(args[2]) then return 0 end
  return redis.call('HGETALL', keys[2])
end

local function reply(keys, args)
  local answer = add_reply(keys[1], args[1], args[2], args[3], args[4])
  if answer == 1 then return 1 end
  return redis.error_reply(answer)
end

-- Consumers of a worker that is gone: nothing pending and idle past the limit, checked and deleted in one step (a
-- consumer given an entry in between keeps it: deleting it would drop its pending entries for good).
local function forget(keys, args)
  local gone = {{}}
  for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', keys[1], args[1])) do
    local info = {{}}
    for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
    if info['pending'] == 0 and info['idle'] > tonumber(args[2]) and info['name'] ~= args[3] then
      redis.call('XGROUP', 'DELCONSUMER', keys[1], args[1], info['name'])
      gone[#gone + 1] = info['name']
    end
  end
  return gone
end

redis.register_function('{SUBMIT}', submit)
redis.register_function('{PUBLISH}', publish)
redis.register_function('{PART}', part)
redis.register_function('{FORGET}', forget)
redis.register_function('{PUBLISH_AS}', publish_as)
redis.register_function('{PART_AS}', part_as)
redis.register_function('{REPLY}', reply)
redis.register_function('{CANCEL}', cancel)
redis.register_function{{function_name = '{REVISION_FUNCTION}', callback = function() return REVISION end,
                         flags = {{'no-writes'}}}}
"""


@dataclass(frozen=True)
class Loaded:
    """What ``ensure`` found and did: the revision now loaded (the lowest over a cluster's primaries) and
    ``present``, ``loaded`` or ``replaced``."""

    revision: int
    action: str


def missing(error: BaseException) -> bool:
    """Whether a Redis error says that a function is not loaded (a server restarted empty, FUNCTION FLUSH)."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()


Step = tuple[str, tuple[Any, ...], dict[str, Any]]  # a redis-py method, its arguments and keywords


def _plan(replace_older: bool, cluster: bool, again: bool = True) -> Generator[Step, Any, Loaded]:
    """Read the loaded revision (on every primary of a cluster), load or replace if needed."""
    target = {"target_nodes": "primaries"} if cluster else {}
    loaded: int | None
    try:
        reply = yield "execute_command", ("FCALL", REVISION_FUNCTION, 0), target
        loaded = min(int(value) for value in (reply.values() if isinstance(reply, dict) else [reply]))
    except redis.ResponseError as error:
        if not missing(error):
            raise
        loaded = None  # on one primary at least
    if loaded is not None and (loaded >= REVISION or not replace_older):
        return Loaded(loaded, "present")
    try:
        # REPLACE only over an older revision (or a cluster, where some primaries may have it): two clients that
        # find it missing load it once, the second one's load refused.
        yield "function_load", (CODE,), {"replace": loaded is not None or cluster}
    except redis.exceptions.NoPermissionError:
        raise LibraryUnavailable(
            f"the Redis function library {LIBRARY} (revision {REVISION}) is "
            f"{'missing' if loaded is None else f'at revision {loaded}'} on this server and this user may not "
            f"load it: run `dq-worker load-functions` with an admin's Redis URL") from None
    except redis.ResponseError as error:
        if "already exists" not in str(error) or not again:
            raise
        return (yield from _plan(replace_older, cluster, again=False))  # another client loaded it: look again
    return Loaded(REVISION, "loaded" if loaded is None else "replaced")


def _cluster(client: Any) -> bool:
    import redis.asyncio as aioredis

    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def ensure(client: Any, replace_older: bool = True) -> Loaded:
    """Make the library available on the client's server (every primary of a cluster); raises LibraryUnavailable
    when it is missing or older (with ``replace_older``) and the user may not ``FUNCTION LOAD``."""
    plan, reply, error = _plan(replace_older, _cluster(client)), None, None
    while True:
        try:
            method, args, kwargs = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = getattr(client, method)(*args, **kwargs), None
        except redis.ResponseError as failed:
            reply, error = None, failed


async def aensure(client: Any, replace_older: bool = True) -> Loaded:
    """``ensure`` for an asyncio client."""
    plan, reply, error = _plan(replace_older, _cluster(client)), None, None
    while True:
        try:
            method, args, kwargs = plan.throw(error) if error is not None else plan.send(reply)
        except StopIteration as finished:
            return finished.value
        try:
            reply, error = await getattr(client, method)(*args, **kwargs), None
        except redis.ResponseError as failed:
            reply, error = None, failed
