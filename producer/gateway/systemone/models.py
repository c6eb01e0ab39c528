"""Routing by model: the name a System One call sends (or one of the gateway's aliases for it, ``--model-alias
jev-latest=my-decider``) to the namespace whose live workers serve it, among those the caller's key may use
(producer/client/served.py: a namespace is one model's queue), and ``GET /v1/models`` from the same.

Each namespace's heartbeats are read at most once a second (``FRESH_S``) whatever the load, with one read at a
time per namespace; a name not found is looked for again in heartbeats at most ``MISS_S`` old before the call
is refused 404 naming the models served, so a model whose first worker has just come up is found, and a model
nobody serves is refused at once, never queued to wait for a worker.

An alias never shadows a served name: ``dq-gateway`` refuses to start (exit 2) with an alias that names a
model its namespaces' live workers serve, and an alias whose name a worker serves later (one that starts after
the gateway) is logged once and no longer routed by, for any caller: ``--model-alias decider-b=decider-a``
once sent calls naming decider-b to decider-a.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from ...client.served import ServedModel, catalog
from ...wire.keys import Keys
from ..front.access import Access
from ..front.replies import RETRY_AFTER_S, Refused

log = logging.getLogger("producer.gateway")
FRESH_S = 1.0  # a namespace's catalog is read again once it is older than this
MISS_S = 0.2  # ... or this, for a name it does not hold


class Models:
    """The served models by name, per namespace, read from heartbeats through ``connection()`` (the gateway's
    pool, made when it starts). ``everywhere``: every namespace the gateway reaches, where an alias may be
    shadowed."""

    def __init__(self, connection: Callable[[], Any], aliases: dict[str, str],
                 everywhere: tuple[str, ...] = ()) -> None:
        self.connection, self.aliases, self.everywhere = connection, aliases, everywhere
        self.shadowed: set[str] = set()  # aliases a live worker serves as a name of its own: never routed by
        self.seen: dict[str, tuple[float, dict[str, ServedModel]]] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    async def _catalog(self, namespace: str, fresh_s: float) -> dict[str, ServedModel]:
        at, found = self.seen.get(namespace, (-1e9, {}))
        if time.monotonic() - at <= fresh_s:
            return found
        # Those that found it stale wait for one read.
        async with self.locks.setdefault(namespace, asyncio.Lock()):
            at, found = self.seen.get(namespace, (-1e9, {}))
            if time.monotonic() - at <= fresh_s:
                return found
            try:
                beats = await self.connection().hgetall(Keys(namespace).workers())
            except redis.exceptions.NoPermissionError:
                raise Refused(503, "unavailable", "the gateway's Redis user may not read the workers' heartbeats "
                              f"({Keys(namespace).workers()}), so it cannot route by model",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            found = catalog(beats, namespace, time.time())
            self.seen[namespace] = (time.monotonic(), found)
            return found

    async def served(self, access: Access, fresh_s: float = FRESH_S) -> dict[str, ServedModel]:
        """The models served where ``access`` may send, by each of their names: a name served in several of
        its namespaces is the first one's."""
        if len(access.model_namespaces) == 1:  # the usual case: the catalog itself (read only)
            return await self._catalog(access.model_namespaces[0], fresh_s)
        out: dict[str, ServedModel] = {}
        for namespace in access.model_namespaces:
            for name, model in (await self._catalog(namespace, fresh_s)).items():
                out.setdefault(name, model)
        return out

    async def serves(self, namespace: str, name: str) -> bool:
        """Whether a live worker of ``namespace`` serves ``name`` (heartbeats read at most once a second)."""
        return name in await self._catalog(namespace, FRESH_S)

    async def route(self, access: Access, name: str) -> ServedModel:
        """The served model ``name`` (or the alias ``name``) is, for this caller; 404 naming the served ones.
        A served name wins over an alias of the same name, for every caller: the alias is then never routed
        by (``_shadow``)."""
        found = await self._pick(access, name, FRESH_S)
        if found is None:
            found = await self._pick(access, name, MISS_S)
        if found is None:
            target = self.aliases.get(name) if name not in self.shadowed else None
            listed = sorted(self._names(await self.served(access)))
            raise Refused(404, "model_not_found", f"no live worker serves the model {name[:130]!r}"
                          + (f" (an alias of {target!r})" if target else "")
                          + f"; served: {', '.join(listed) or 'none'}", "model")
        return found

    async def _pick(self, access: Access, name: str, fresh_s: float) -> ServedModel | None:
        found = await self.served(access, fresh_s)
        if name in found:
            if name in self.aliases:
                self._shadow(name, found[name])
            return found[name]
        target = self.aliases.get(name)
        if target is None or name in self.shadowed:
            return None
        for namespace in self.everywhere:  # served anywhere the gateway reaches: the alias is no route
            if name in (elsewhere := await self._catalog(namespace, fresh_s)):
                self._shadow(name, elsewhere[name])
                return None
        return found.get(target)

    def _shadow(self, alias: str, model: ServedModel) -> None:
        if alias not in self.shadowed:
            self.shadowed.add(alias)
            log.warning("--model-alias %s=%s is not used: a live worker of namespace %s serves a model named "
                        "%r; calls naming it go to that model (an alias never shadows a served name)", alias,
                        self.aliases[alias], model.namespace, alias)

    def _names(self, found: dict[str, ServedModel]) -> dict[str, ServedModel]:
        """Every name a caller may send: the served ones and the aliases whose model is served."""
        aliases = {alias: found[target] for alias, target in self.aliases.items()
                   if target in found and alias not in self.shadowed}
        return {**aliases, **found}

    async def listing(self, access: Access) -> dict[str, Any]:
        """``GET /v1/models``'s body: each name a caller may send, with what it is."""
        names = self._names(await self.served(access))
        cards = []
        for name, model in sorted(names.items()):
            alias = "" if name == model.name else f"an alias of {model.name}; "
            cards.append({"name": name, "description": f"{alias}decision model served by {model.workers} live "
                          f"worker{'s' if model.workers != 1 else ''}", "release_date": ""})
        return {"models": cards}


def shadowing(aliases: dict[str, str], beats: dict[str, Any], now: float) -> list[str]:
    """The aliases (``ALIAS=NAME``) that name a model live workers serve, from each namespace's heartbeats
    (``HGETALL Keys.workers``): what ``dq-gateway`` refuses to start with."""
    served = {name: namespace for namespace, heartbeats in beats.items()
              for name in catalog(heartbeats, namespace, now)}
    return [f"{alias}={target} (namespace {served[alias]} serves a model named {alias!r})"
            for alias, target in aliases.items() if alias in served]
