"""The function library's Lua text, ``CODE``, and the names of its functions: every script the protocol runs
inside Redis (producer/wire/library.py loads it). Each function's keys and arguments are beside its name; what
it answers is in the Lua. A change of ``CODE`` is a new ``REVISION``, which keeps every earlier function
(docs/OPERATIONS.md, "Redis ACL users": rolling upgrades).
"""

from __future__ import annotations

import re

from .keys import LANES, MAX_BODY_BYTES, PROTOCOL, Field, Keys
from .records import LUA as RECORDS

LIBRARY = f"dq_v{PROTOCOL}"
SUBMIT = f"{LIBRARY}_submit"  # KEYS: a request stream. ARGV: limit (0: none), then id, body per request
# Revision 1's publication, which no current worker calls: kept for workers of revision 1 during a rolling
# upgrade (a revision keeps every function); it goes with wire protocol v2 (library dq_v2).
PUBLISH = f"{LIBRARY}_publish"  # KEYS: result, parts, body. ARGV: result JSON, TTL s. 1 published now, 0 already
PART = f"{LIBRARY}_part"  # KEYS: parts, result. ARGV: index, count, part JSON, TTL s. -1 done, 0 wait, else all
# Revision 2: publication that records and tells who published (so that a call re-sent after its answer was
# lost knows it published), adds the reply in the same call on one server, and clears what a request reusing a
# published id left; and the reply alone (Redis Cluster, where a reply stream has its own slot). Answers: see
# the Lua below. Revision 3: a reply stream's length capped (an optional last argument of publish_as and
# reply).
PUBLISH_AS = f"{LIBRARY}_publish_as"  # KEYS: result, parts, body[, reply]. ARGV: JSON, TTL s, publisher[, id, cap]
PART_AS = f"{LIBRARY}_part_as"  # KEYS: result, parts, body. ARGV: index, count, part JSON, TTL s
REPLY = f"{LIBRARY}_reply"  # KEYS: a reply stream. ARGV: request id, result JSON, TTL s[, cap]. 1, or an error
FORGET = f"{LIBRARY}_forget"  # KEYS: a work stream. ARGV: group, idle limit ms, own consumer name. Names deleted
# Revision 4, on one server (their keys span slots: on Redis Cluster the worker publishes before it copies the
# dead letter, and the requeue tool runs its steps one by one). Answers: see the Lua below. And each request's
# record (records.py: ``submit`` writes it, ``cancel`` marks it).
DEAD_LETTER = f"{LIBRARY}_dead_letter"  # KEYS: result, parts, body, dead stream[, reply]. ARGV: see the Lua
REQUEUE = f"{LIBRARY}_requeue"  # KEYS: dead stream, request stream[, result]. ARGV: dead-letter id, group
CANCEL = f"{LIBRARY}_cancel"  # KEYS: cancel stream, counts, records. ARGV: ms, ids. An answer per id (records.py)
# Revision 5: a request sent again under the id of one cancelled and not answered yet keeps the cancel mark
# (records.py): its status says what happens to it, ``cancelled``.
REVISION_FUNCTION = f"{LIBRARY}_revision"  # no keys: this library's REVISION
REVISION = 5  # bumped on every change of CODE (tests/unit/test_library_code.py pins each revision's hash)
MAX_BATCH = 1000  # requests per submit call: bounds the time Redis spends in one call
MAX_DEAD_FIELDS = 1000  # fields a dead letter keeps of its entry (a request entry has one): Lua's unpack is bounded


def _stream_pattern(template: str) -> str:
    """A Lua pattern of one kind of request stream (its name with namespace ``\0`` and shard ``\1``), in any
    namespace and shard."""
    escaped = re.sub(r"([\^$()%.\[\]*+\-?])", r"%\1", template)
    return "^" + escaped.replace("\0", ".+").replace("\1", "%d+") + "$"


# Streams the submit function writes to, each lane's request stream: producers reach no other key through it.
SUBMIT_STREAMS = tuple(Keys("\0", "\1").requests_in(lane) for lane in LANES)
# A dead-letter field the dead letter writes itself, after the entry's own (producer/wire/keys.py, Field)
OWN_DEAD_FIELDS = (Field.STREAM, Field.LANE, Field.ENTRY_ID, Field.DELIVERIES, Field.REASON)
DEAD_STREAMS = Keys("\0", "\1").dead  # the requeue function's first key: a dead-letter stream

# The Lua text is part of the wire (its digest is pinned per revision).
CODE = f"""#!lua name={LIBRARY}
-- decision-queue, wire protocol v{PROTOCOL}, revision {REVISION} (producer/wire/functions.py, records.py)
local REVISION = {REVISION}
local MAX_BODY = {MAX_BODY_BYTES}
local MAX_BATCH = {MAX_BATCH}
local STREAMS = {{{", ".join(repr(_stream_pattern(template)) for template in SUBMIT_STREAMS)}}}
local DEAD = {repr(_stream_pattern(DEAD_STREAMS))}
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

-- A dead letter and its request's result, published as ``publish_as`` does (with its reply), in one step: a requeue
-- sees both or neither (and waits for the entry's acknowledgement: ``requeue``). KEYS: result, parts, body, dead
-- stream[, reply]. ARGV: result JSON, TTL s, publisher, request id, reply cap, dead cap, then the dead letter's
-- fields (name, value, ...). Answers as ``publish_as``.
local function dead_letter(keys, args)
  local fields = {{}}
  for i = 7, #args do fields[#fields + 1] = args[i] end
  redis.call('XADD', keys[4], 'MAXLEN', '~', args[6], '*', unpack(fields))
  return publish_as({{keys[1], keys[2], keys[3], keys[5]}}, {{args[1], args[2], args[3], args[4], args[5]}})
end

local OWN = {{{", ".join(f"['{name}'] = true" for name in OWN_DEAD_FIELDS)}}}

-- A dead letter back to its request stream, in one step: the request's result removed first if it is the
-- dead_lettered error (any other result stays, and nothing is requeued), the entry's own fields added again, the
-- dead letter deleted; not while its entry is still pending there (its worker has not acknowledged it: one that died
-- in between would dead-letter it again). KEYS: dead stream, request stream (the entry's)[, result]. ARGV: dead-letter
-- id, group. Answers {{'requeued', new entry id}}, {{'gone'}} (no such dead letter: requeued or purged meanwhile),
-- {{'pending'}}, {{'answered', its code or 'ok'}}, or {{'empty'}} (the dead letter kept none of its entry's fields).
local function requeue(keys, args)
  if not string.match(keys[1], DEAD) or not request_stream(keys[2]) then
    return redis.error_reply('INVALID expected: a dead-letter stream, a request stream[, a result]')
  end
  local found = redis.call('XRANGE', keys[1], args[1], args[1])[1]
  if not found then return {{'gone'}} end
  local entry = field(found[2], '{Field.ENTRY_ID}')
  if string.match(entry, '^%d+%-%d+$') and redis.call('EXISTS', keys[2]) == 1 then
    local ok, held = pcall(redis.call, 'XPENDING', keys[2], args[2], entry, entry, 1)
    if ok and held[1] then return {{'pending'}} end
  end
  local first = keys[3] and redis.call('XRANGE', keys[3], '-', '+', 'COUNT', 1)[1]
  if first then
    local ok, result = pcall(cjson.decode, field(first[2], '{Field.BODY}'))
    local code = 'unreadable'
    if ok and type(result) == 'table' then
      code = result.status == 'ok' and 'ok' or (type(result.error) == 'table' and tostring(result.error.code))
    end
    if code ~= 'dead_lettered' then return {{'answered', code or 'unreadable'}} end
    redis.call('DEL', keys[3])
  end
  local fields = {{}}
  for i = 1, #found[2], 2 do
    if not OWN[found[2][i]] then
      fields[#fields + 1] = found[2][i]
      fields[#fields + 1] = found[2][i + 1]
    end
  end
  if #fields == 0 then return {{'empty'}} end
  local id = redis.call('XADD', keys[2], '*', unpack(fields))
  redis.call('XDEL', keys[1], args[1])
  return {{'requeued', id}}
end

redis.register_function('{SUBMIT}', submit)
redis.register_function('{PUBLISH}', publish)
redis.register_function('{PART}', part)
redis.register_function('{FORGET}', forget)
redis.register_function('{PUBLISH_AS}', publish_as)
redis.register_function('{PART_AS}', part_as)
redis.register_function('{REPLY}', reply)
redis.register_function('{DEAD_LETTER}', dead_letter)
redis.register_function('{REQUEUE}', requeue)
redis.register_function('{CANCEL}', cancel)
redis.register_function{{function_name = '{REVISION_FUNCTION}', callback = function() return REVISION end,
                         flags = {{'no-writes'}}}}
"""
