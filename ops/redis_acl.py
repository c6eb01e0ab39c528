"""Redis ACL users of a deployment, least privilege per role, written as an ``aclfile`` (Redis 7+).

    python ops/redis_acl.py [--namespace dq] > users.acl     # passwords from DQ_ACL_<ROLE>_PASSWORD, else generated
    python ops/redis_acl.py --development > ops/redis/users.acl   # the compose file's well-known passwords

Roles:
- producer: enqueue in either lane (plain XADD or the submit script) and read results and reply streams. No consumer-group
  commands, no deletes, no writes to results (it cannot forge an answer).
- worker: what the daemon does (read the group, claim, acknowledge, publish through its scripts, fan out, dead
  letters, heartbeat), inside the namespace only. DEL and EXPIRE only on per-request keys and reply streams
  (a selector), so even a worker cannot drop a work stream; no XTRIM, no group deletion, no FLUSH, CONFIG or KEYS.
- monitor: read-only stream metadata and INFO for Prometheus, KEDA and ``python -m producer stats``; no payloads.
- admin: everything, for operators.
- default (no credentials): PING only, for container health checks.

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

from producer.keys import ANY, HIGH, Keys  # noqa: E402

# Connection set-up and the cluster topology a cluster client reads. (No CLIENT SETINFO: 7.0 lacks it, so the
# project's clients do not send it.)
CONNECT = "+ping +hello +client|setname +client|id +command +cluster|slots +cluster|shards +cluster|nodes"

# Key patterns (the placeholders) are the deployment's own names, from producer/keys.py; see ``patterns``.
ROLES = {
    "producer": (
        "{connect} +xadd +xlen +xread +xrange +evalsha +script|load "
        "~{requests} ~{high_requests} %R~{results} %R~{replies}"
    ),
    "worker": (
        "{connect} +xreadgroup +xack +xdel +xautoclaim +xclaim +xpending +xgroup|create +xgroup|delconsumer "
        "+xinfo|groups +xinfo|consumers +xlen +xadd "
        "+evalsha +script|load +script|exists +exists +hlen +hgetall +hset +hdel +get +set "
        "~{everything} "
        # scripts delete a published request's parts and body and expire results: nothing else may go away
        "(+del +expire ~{results} ~{parts} ~{bodies} ~{replies})"
    ),
    "monitor": (
        "{connect} +xinfo|groups +xinfo|stream +xinfo|consumers +xlen +xpending +hkeys +hlen +hgetall +info "
        "%R~{everything}"
    ),
    "admin": "~* &* +@all",
}


# Well known, for a local docker compose only: ops/compose.yaml uses them unless DQ_ACL_<ROLE>_PASSWORD is set.
DEVELOPMENT_PASSWORDS = {role: f"dev-{role}-password" for role in ROLES}


def patterns(namespace: str) -> dict[str, str]:
    """The key patterns the roles name: every shard's request streams (both lanes), every request's keys, the reply
    streams."""
    every = Keys(namespace, ANY)
    return {"everything": every.everything, "requests": every.requests, "high_requests": every.requests_in(HIGH),
            "results": every.result(ANY),
            "parts": every.parts(ANY), "bodies": every.body(ANY), "replies": every.reply_prefix + ANY}


def password_hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def render(passwords: dict[str, str], namespace: str = "dq") -> str:
    """The aclfile text: one ``user`` line per role (every role in ROLES needs a password)."""
    lines = ["user default on nopass resetkeys resetchannels -@all +ping"]  # aclfiles take no comments
    for role, rules in ROLES.items():
        body = rules.format(connect=CONNECT, **patterns(namespace))
        lines.append(f"user {role} on {password_hash(passwords[role])} resetkeys resetchannels -@all {body}"
                     if role != "admin" else f"user {role} on {password_hash(passwords[role])} {body}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace", default="dq", help="the deployment's namespace (DQ_NAMESPACE)")
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
