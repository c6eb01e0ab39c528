"""The worker's Lua scripts, as text: the publication of a result (exactly once), the parts of a fanned-out
request, and replies. Each touches the keys of one request (one Redis Cluster slot), or one reply stream; callers
(publisher.py) name the keys and arguments each one takes, as written above it.
"""

from __future__ import annotations

from producer.keys import Field

# Lua: the value of a field in a flat [name, value, ...] array (an entry's fields), or ''.
_FIELD = "local function field(f, name) for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end return '' end"
# Lua: add a reply to a reply stream, refreshing its TTL: 1, or why Redis refused (a key of another type is left
# untouched, no entry and no TTL; an ACL). Never raises: a reply must not undo what the script did before it.
_REPLY = f"""
local function reply(key, id, body, ttl)
  local kind = redis.pcall('TYPE', key)
  if kind.err then return kind.err end
  if kind.ok ~= 'stream' and kind.ok ~= 'none' then return 'WRONGTYPE the reply stream is a ' .. kind.ok end
  local added = redis.pcall('XADD', key, '*', '{Field.REPLY_ID}', id, '{Field.BODY}', body)
  if type(added) == 'table' and added.err then return added.err end
  redis.pcall('EXPIRE', key, ttl)
  return 1
end
"""
# What a publication answers once a result is stored: {'published', who published it, and (when it was not this
# call) the stored result JSON}. Who: ``Outcome.publisher``, kept in the result entry, so that a call re-run after
# its answer was lost (redis-py re-sends a pipeline on a dropped connection) still learns that it published.
_STORED = f"""
{_FIELD}
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first then
  redis.call('DEL', KEYS[2], KEYS[3])  -- a part or a stored body of a request that reused a published id: garbage
  return {{'published', field(first[2], '{Field.PUBLISHER}'), field(first[2], '{Field.BODY}')}}
end
"""
# KEYS: result stream, parts hash, body key[, reply stream]. ARGV: result JSON, TTL seconds, publisher[, request id].
# With a reply stream (one Redis, not Cluster: its slot is not the request's), the reply is added in the same
# script: exactly once with the publication. Answers {'published', publisher, '', 1 or why the reply was refused}.
PUBLISH = _REPLY + _STORED + f"""
redis.call('XADD', KEYS[1], '*', '{Field.BODY}', ARGV[1], '{Field.PUBLISHER}', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
local replied = 0
if KEYS[4] then replied = reply(KEYS[4], ARGV[4], ARGV[1], ARGV[2]) end
return {{'published', ARGV[3], '', replied}}
"""
# KEYS: result stream, parts hash, body key. ARGV: part index, part count, part JSON, TTL seconds.
# As PUBLISH once the request has its result; 0: parts still missing; else every part, as HGETALL gives them.
PART = _STORED + """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
if redis.call('HLEN', KEYS[2]) < tonumber(ARGV[2]) then return 0 end
return redis.call('HGETALL', KEYS[2])
"""
# Redis Cluster: the reply on its own, after the publication (at least once). KEYS: reply stream. ARGV: request
# id, result JSON, TTL seconds.
REPLY = _REPLY + """
local answer = reply(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if answer == 1 then return 1 end
return redis.error_reply(answer)
"""
