"""Who may do what: the caller an ``Authorization: Bearer`` header names, and how many of its requests are
being answered at once.

A token is compared with every key's, each comparison in constant time over SHA-256 digests (equal lengths, so
the time says nothing about the token's length or its first differing byte), and no comparison is skipped once
one matched. The caller's namespace comes from its key alone: nothing in a request (path, header or field)
names another, so no call reaches another tenant's streams or results.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ...wire.keys import LANES, Priority
from ..config import ApiKey, GatewayConfig

OPEN = "open"  # the caller's name when the gateway has no keys


@dataclass(frozen=True)
class Access:
    """An authenticated caller: its key's name, namespace (its tenant), lanes and in-flight limit, what its
    hang-up does to the requests it waits for (cancels.py), and the namespaces whose models it may name, in
    the order they are looked in."""

    name: str
    namespace: str
    lanes: frozenset[Priority]
    max_inflight: int
    hang_up: str = "cancel"
    model_namespaces: tuple[str, ...] = ()


class Keyring:
    """The gateway's keys; ``find`` turns a bearer header into an Access, or None."""

    def __init__(self, config: GatewayConfig) -> None:
        self.open = not config.keys
        self._keys: list[tuple[bytes, Access]] = [(key.digest, self._access(config, key)) for key in config.keys]
        self._anyone = Access(OPEN, config.deployment.namespace, frozenset(LANES), config.max_inflight_per_key,
                              "cancel", config.model_namespaces_of(None))

    @staticmethod
    def _access(config: GatewayConfig, key: ApiKey) -> Access:
        return Access(key.name, config.namespace_of(key), key.lane_set(),
                      key.max_inflight or config.max_inflight_per_key, key.hang_up, config.model_namespaces_of(key))

    def find(self, authorization: str | None) -> Access | None:
        if self.open:
            return self._anyone
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for key_digest, access in self._keys:  # every key, always: the time does not say which one matched
            if hmac.compare_digest(digest, key_digest):
                found = access
        return found


class Inflight:
    """Requests being answered per caller (a batch counts each of its requests). One event loop: no lock."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def take(self, access: Access, count: int) -> bool:
        """Hold ``count`` more for ``access``, unless that would pass its limit."""
        now = self.held.get(access.name, 0)
        if now + count > access.max_inflight:
            return False
        self.held[access.name] = now + count
        return True

    def give_back(self, name: str, count: int) -> None:
        left = self.held.get(name, 0) - count
        if left > 0:
            self.held[name] = left
        else:
            self.held.pop(name, None)
