"""Queue stats, a plan of the core (producer/client/plans.py) that both client faces run (``Client.stats``,
``AsyncClient.stats``)."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from ..plumbing.commands import Command, command
from ..plumbing.supported import lag_of
from ..wire.keys import GONE_S, GROUP, LANES, Keys, beat_age, beat_live, text
from ..wire.records import FOUND
from .plans import Plan, Producer
from .served import catalog


def stats(core: Producer) -> Plan[dict[str, Any]]:
    """Totals over every shard, then each shard: for each lane (``lanes``: high, normal) the request and part
    streams' lengths and the worker group's pending, lag and live consumers; ``requests`` and ``prompts``:
    both lanes together; dead letters; cancels asked, by what each found; the live workers (``workers``: how
    many) and every heartbeat (``heartbeats``: each worker's name, shard, model, engine, state, entries held
    and the age of its last beat; state ``gone`` when that is ``GONE_S`` or older); ``models``: the models the
    live workers serve, by the name their results say, with every name each answers to and its workers. Live:
    a worker whose heartbeat is younger than ``GONE_S`` (workers delete the gone: presence.py), and a consumer
    that is such a worker's (a heartbeat is written under its consumer name) or holds entries. Not the
    consumer's idle time: Redis 7.0 counts a read only when it returns entries, so a worker blocked on a quiet
    stream looked gone there after 30 s. The lag is the server's, or the length less pending when the server
    cannot count it (``servers.lag_of``)."""
    beats = yield command("HGETALL", core.keys.workers())
    now = time.time()
    live = {text(name) for name, raw in beats.items() if beat_live(raw, now)}
    shards = []
    for shard in range(core.shards):
        keys, entry = Keys(core.keys.namespace, shard), {"shard": shard}
        lanes: dict[str, dict[str, Any]] = {}
        for lane in LANES:  # plain str keys: the dict is printed and dumped as it is
            lanes[lane.value] = {}
            for name, stream in (("requests", keys.requests_in(lane)), ("chunks", keys.parts_in(lane))):
                lanes[lane.value][name] = yield from _stream_stats(stream, live)
        for name in ("requests", "chunks"):
            entry[name] = _combine([lanes[lane.value][name] for lane in LANES], consumers=max)
        entry["lanes"] = lanes
        entry["dead_letters"] = yield command("XLEN", keys.dead)
        entry["cancels"] = yield from _cancel_counts(keys)
        shards.append(entry)
    totals: dict[str, Any] = {name: _combine([s[name] for s in shards]) for name in ("requests", "chunks")}
    totals["lanes"] = {lane.value: {name: _combine([s["lanes"][lane.value][name] for s in shards])
                                    for name in ("requests", "chunks")} for lane in LANES}
    totals["dead_letters"] = sum(s["dead_letters"] for s in shards)
    totals["cancels"] = {found: sum(s["cancels"].get(found, 0) for s in shards) for found in FOUND}
    totals["workers"] = len(live)
    totals["heartbeats"] = sorted((_heartbeat(name, raw, now) for name, raw in beats.items()),
                                  key=lambda beat: (str(beat["shard"]), beat["name"]))
    served = {m.name: m for m in catalog(beats, core.keys.namespace, now).values()}
    totals["models"] = {name: {"names": list(m.names), "workers": m.workers} for name, m in sorted(served.items())}
    return {**totals, "shards": shards}


def _heartbeat(name: Any, raw: Any, now: float) -> dict[str, Any]:
    """One worker's heartbeat, as stats show it: any field the worker did not write (an older worker, or a
    beat that is not JSON) is None."""
    try:
        beat = json.loads(raw)
        beat = beat if isinstance(beat, dict) else {}
    except ValueError:
        beat = {}
    age = beat_age(raw, now)
    return {"name": text(name), "shard": beat.get("shard"), "model": beat.get("model"), "engine": beat.get("engine"),
            "state": "gone" if age >= GONE_S else beat.get("state"), "held": beat.get("inflight"),
            "beat_age_s": round(age, 1) if age != float("inf") else None}


def _cancel_counts(keys: Keys) -> Plan[dict[str, int]]:
    """Cancels asked of a shard, by what each found (records.FOUND); none where this user may not read them
    (an aclfile older than cancels)."""
    try:
        counts = yield command("HGETALL", keys.cancel_counts)
    except redis.exceptions.NoPermissionError:
        return {}
    return {found: int(counts.get(found, counts.get(found.encode(), 0))) for found in FOUND}


def _stream_stats(stream: str, live: set[str]) -> Plan[dict[str, Any]]:
    """One stream's length, and the worker group's pending, lag and consumers on it (once the group exists):
    those of ``live`` workers, and those holding entries."""
    stream_stats = {"length": (yield command("XLEN", stream))}
    try:
        groups = yield Command(("XINFO GROUPS", stream), stream)
    except redis.ResponseError as error:
        if "no such key" not in str(error).lower():  # NOPERM and the like are the caller's to see
            raise
        groups = []
    for group in groups:
        if group["name"] in (GROUP, GROUP.encode()):
            consumers = yield Command(("XINFO CONSUMERS", stream, GROUP), stream)
            stream_stats.update(pending=group["pending"],
                                lag=lag_of(stream_stats["length"], group["pending"], group.get("lag")),
                                consumers=sum(1 for c in consumers if c["pending"] or text(c["name"]) in live))
    return stream_stats


def _combine(parts: list[dict[str, Any]], consumers: Any = sum) -> dict[str, Any]:
    """Field-wise sum of stream stats; ``consumers`` combines consumer counts (``max`` over one shard's lanes)."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if name == "consumers":
                out[name] = consumers((out.get(name, 0), value))
            else:
                out[name] = None if value is None or out.get(name, 0) is None else out.get(name, 0) + value
    return out
