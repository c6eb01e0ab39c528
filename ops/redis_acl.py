"""Redis ACL users of a deployment, least privilege per role, written as an ``aclfile`` (Redis 7+, Valkey 7.2+).

    python ops/redis_acl.py [--namespace dq] > users.acl     # passwords from DQ_ACL_<ROLE>_PASSWORD, else generated
    python ops/redis_acl.py --development > ops/redis/users.acl   # the compose file's well-known passwords
    python ops/redis_acl.py --namespace 'dq*' > users.acl     # a glob: every namespace it matches (several models)

No role but admin runs Lua of its own (no EVAL, EVALSHA, SCRIPT or FUNCTION LOAD): Redis Functions of the
queue's library (producer/wire/library.py, loaded by ``dq-worker load-functions`` as admin) are called with FCALL.
Redis checks every command a function runs against its caller's user, so each role also holds the commands its
functions run, on exactly those keys. Selectors (the parenthesised groups) give each command its keys:

- producer: FCALL the submit function on request streams, either lane's (and the XADD, XLEN it runs),
  XREAD/XRANGE results and reply streams. It cannot read request streams, consume, delete, write results, or run
  its own Lua. It may read the heartbeat hash (whether any worker is alive, which models are served), nothing else
  of the workers'. Durable mode: WAIT, and PUBLISH on one channel nobody reads (``Keys.durable``: what a reader's
  WAIT covers); on Redis Cluster, where PUBLISH is not replicated, SET of the short-lived read marks instead
  (``Keys.durable_mark``). Requests' records (what submit writes, a cancel marks, status reads), the cancel function
  (a notice, a count), and what status reads besides: the group and pending metadata of request streams, whether a
  result exists, how many parts of a fan-out are done. Who may cancel: a producer of the namespace, and admin. The
  gateway, which runs as this user: SET/GET/DEL of System One calls' mappings (``Keys.call``).
- worker: the group commands on the work streams (both lanes'); XADD to part and dead-letter streams; SET/GET
  stored bodies; the heartbeat hash; the publish and part functions and what they run on per-request keys and reply
  streams; WAIT (durable mode); requests' records (a take's cancel mark and note, how it was answered); reading the
  cancel notices. No DEL, SET, EXPIRE, RENAME, XTRIM, XSETID or group deletion can reach a work
  stream.
- monitor: counts only: XLEN, XINFO GROUPS/CONSUMERS, XPENDING, INFO, the heartbeat hash; for redis_exporter,
  LATENCY LATEST/HISTOGRAM and SLOWLOG LEN; status without payloads (records, EXISTS of a result, HLEN of a fan-out's
  parts) and the cancel counts. No XINFO STREAM (it returns the first and last entries), no XRANGE, no SLOWLOG GET
  (it shows commands' arguments), no CONFIG, no body, result or share.
- admin: everything, for operators (and for loading the function library).
- default: off, so every connection authenticates as one of the roles above (a client without credentials gets
  NOAUTH, PING included). Its rules allow every command because Redis (7.0 to 8.2; redis/redis#14541, fixed later)
  checks them when it replays a MULTI block of the AOF at a restart: with a restricted default user, the writes of
  every function call that made several (publication, submit with records, dead letters) are dropped then, in
  silence. A disabled user is never one a client can be, so the rules give nobody anything.

Passwords are stored as SHA-256 (``#<hex>``), never in clear. ``ops/redis/users.acl`` is this script's output with
the compose file's development passwords (a test keeps the two equal); render your own for anything real.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from producer.wire.keys import ANY, HIGH, Keys  # noqa: E402

# Connection set-up and the cluster topology a cluster client reads. (No CLIENT SETINFO: 7.0 lacks it, so the
# project's clients do not send it.)
CONNECT = "+ping +hello +client|setname +client|id +command +cluster|slots +cluster|shards +cluster|nodes"

# Key patterns (the placeholders) are the deployment's own names, from producer/wire/keys.py; see ``patterns``.
ROLES = {
    "producer": (
        # the submit function's keys, and the commands it runs (also callable directly: see docs/OPERATIONS.md)
        "{connect} +fcall +xadd +xlen ~{requests} ~{high_requests} "
        "(+xread +xrange %R~{results} %R~{replies}) "
        "(+hgetall %R~{workers}) "  # live workers: a wait with none says so at once; the gateway's routing by model
        "(+set +get +del ~{calls}) "  # the gateway: a System One call's retries mapped to one request
        "+wait +publish &{durable} (+set %W~{marks}) "  # durable mode: WAIT, and what a reader's WAIT covers
        # requests' records: the submit function writes them (with each one's place), cancel marks them, status reads
        # them and where an entry stands (no payload); the cancel function's keys, its notice and its counts
        "(+del +hset +expire +hmget +hgetall ~{records}) (+xinfo|groups +xpending %R~{requests} %R~{high_requests}) "
        "(+fcall ~{cancels} ~{cancel_counts} ~{records}) (+xadd ~{cancels}) (+hincrby ~{cancel_counts}) "
        "(+exists %R~{results}) (+hlen %R~{shares})"
    ),
    "worker": (
        "{connect} +wait +fcall +xreadgroup +xack +xdel +xautoclaim +xclaim +xpending +xgroup|create +xgroup|createconsumer +xgroup|delconsumer "
        "+xinfo|groups +xinfo|consumers +xinfo|stream +xlen ~{requests} ~{high_requests} ~{part_stream} ~{high_part_stream} "
        "(+xadd +xlen ~{part_stream} ~{high_part_stream} ~{dead}) "  # fan-out parts, dead letters
        "(+set +get ~{bodies}) "  # a fanned-out request's body
        "(+hset +hdel +hget +hgetall +hlen ~{workers}) "  # heartbeats
        # the publish and part functions (FCALL's keys), then what they run; replies beside results; the dead-letter
        # function's dead-letter stream (what it runs there is the worker's own XADD)
        "(+fcall ~{results} ~{shares} ~{bodies} ~{replies} ~{dead}) "
        "(+exists +xrange +xadd +expire ~{results} ~{replies}) (+type ~{replies}) "
        "(+hset +hlen +hgetall +expire ~{shares}) "
        "(+del ~{shares} ~{bodies}) "
        # a request's record: its cancel mark and who took it (at the take), how it was answered; the cancel notices
        "(+hget +hset +expire ~{records}) (+xread +xrevrange %R~{cancels})"
    ),
    "monitor": (
        # counts, and what redis_exporter reads of Redis itself (INFO; latency and slow-log counts, not their entries)
        "{connect} +info +latency|latest +latency|histogram +slowlog|len "
        "+xlen +xinfo|groups +xinfo|consumers +xpending %R~{requests} %R~{high_requests} "
        "%R~{part_stream} %R~{high_part_stream} %R~{dead} "
        "(+hlen +hkeys +hget +hgetall %R~{workers}) "
        # status without payloads: records, whether a result exists, a fan-out's finished parts; cancel counts
        "(+hgetall %R~{records} %R~{cancel_counts}) (+exists %R~{results}) (+hlen %R~{shares})"
    ),
    "admin": "~* &* +@all",
}


# Well known, for a local docker compose only: ops/compose.yaml uses them unless DQ_ACL_<ROLE>_PASSWORD is set.
DEVELOPMENT_PASSWORDS = {role: f"dev-{role}-password" for role in ROLES}


def patterns(namespace: str) -> dict[str, str]:
    """The key patterns the roles name: every shard's work streams (each lane's) and dead-letter stream, every
    request's keys, the reply streams, the heartbeat hash."""
    every = Keys(namespace, ANY)
    return {"requests": every.requests, "high_requests": every.requests_in(HIGH), "part_stream": every.parts,
            "high_part_stream": every.parts_in(HIGH), "dead": every.dead, "results": every.result(ANY),
            "shares": every.shares(ANY), "bodies": every.body(ANY), "replies": every.reply_prefix + ANY,
            "workers": every.workers(), "durable": every.durable(), "marks": every.durable_mark(ANY),
            "records": every.record(ANY), "cancels": every.cancels, "cancel_counts": every.cancel_counts,
            "calls": every.call(ANY)}


def password_hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def render(passwords: dict[str, str], namespace: str = "dq") -> str:
    """The aclfile text: one ``user`` line per role (every role in ROLES needs a password)."""
    lines = ["user default off resetpass ~* &* +@all"]  # aclfiles take no comments; why: the docstring
    for role, rules in ROLES.items():
        body = rules.format(connect=CONNECT, **patterns(namespace))
        lines.append(f"user {role} on {password_hash(passwords[role])} resetkeys resetchannels -@all {body}"
                     if role != "admin" else f"user {role} on {password_hash(passwords[role])} {body}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace", default="dq", help="the deployment's namespace (DQ_NAMESPACE), or a glob "
                        "matching several (dq*: dq, dq-b, ...)")
    parser.add_argument("--development", action="store_true", help="the well-known local passwords")
    args = parser.parse_args(argv)
    if args.development:
        sys.stdout.write(render(DEVELOPMENT_PASSWORDS, args.namespace))
        return 0
    passwords = {}
    for role in ROLES:
        variable = f"DQ_ACL_{role.upper()}_PASSWORD"
        passwords[role] = os.environ.get(variable) or secrets.token_urlsafe(32)
        if variable not in os.environ:
            print(f"{variable}={passwords[role]}", file=sys.stderr)  # generated: shown once, stored only hashed
    sys.stdout.write(render(passwords, args.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
