"""``dq-producer stats`` as a person reads it: one table of the streams (each shard's lanes, and every shard's
together), then one of the workers (each heartbeat: name, shard, model, engine, state, entries held, last
beat). ``--json`` prints ``Client.stats()`` as it is; ``--watch SECONDS`` draws the tables again every
SECONDS, as ``watch`` would, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import redis

from ..wire.errors import DecisionQueueError
from ..wire.keys import GONE_S

# (header, stream, field) of the stream table: the request stream's figures, then the part stream's.
STREAM_COLUMNS = (("REQUESTS", "requests", "length"), ("PENDING", "requests", "pending"),
                  ("LAG", "requests", "lag"), ("PARTS", "chunks", "length"), ("PARTS PENDING", "chunks", "pending"),
                  ("PARTS LAG", "chunks", "lag"), ("CONSUMERS", "requests", "consumers"))
WORKER_COLUMNS = ("WORKER", "SHARD", "MODEL", "ENGINE", "STATE", "HELD", "LAST BEAT")
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen: what watch(1) does between frames


def render(stats: dict[str, Any], namespace: str) -> str:
    """The two tables of one ``Client.stats()`` reading (no clock in it: the same reading renders the
    same)."""
    shards = stats["shards"]
    dead = ", ".join(f"shard {s['shard']}: {s['dead_letters']}" for s in shards) if len(shards) > 1 else ""
    lines = [f"namespace {namespace}: {len(shards)} shard{'s' if len(shards) != 1 else ''}, "
             f"{stats['workers']} worker{'s' if stats['workers'] != 1 else ''} live, "
             f"{stats['dead_letters']} dead letters" + (f" ({dead})" if dead else ""), ""]
    def figures(streams: dict[str, Any]) -> list[str]:
        return [_figure(streams[stream].get(field)) for _, stream, field in STREAM_COLUMNS]

    rows = [[str(shard["shard"]), lane, *figures(streams)] for shard in shards
            for lane, streams in shard["lanes"].items()]
    if len(shards) > 1:
        rows += [["all", lane, *figures(streams)] for lane, streams in stats["lanes"].items()]
    lines += _table(["SHARD", "LANE", *(header for header, _, _ in STREAM_COLUMNS)], rows, numeric_from=2)
    lines.append("")
    beats = stats.get("heartbeats", [])
    if not beats:
        lines.append(f"no worker has a heartbeat in namespace {namespace!r}: nothing will answer until one "
                     "starts (is the namespace right?)")
    else:
        lines += _table(list(WORKER_COLUMNS), [
            [b["name"], *map(_text, (b["shard"], b["model"], b["engine"], b["state"], b["held"])),
             "-" if b["beat_age_s"] is None else f"{b['beat_age_s']:.1f} s ago"] for b in beats], numeric_from=5)
        if any(b["state"] == "gone" for b in beats):
            lines.append(f"gone: no heartbeat for {GONE_S} s or more (a live worker deletes such beats)")
    return "\n".join(lines) + "\n"


def interval(text: str) -> float:
    """--watch's seconds: at least 0.1."""
    value = float(text)
    if not value >= 0.1:  # nan too
        raise argparse.ArgumentTypeError(f"must be at least 0.1 seconds, got {text}")
    return value


def watch(shown: Callable[[], str], every: float, out: TextIO = sys.stdout,
          frames: int | None = None) -> None:
    """Draw what ``shown`` reads every ``every`` seconds until interrupted (or ``frames`` drawn): the screen
    cleared first on a terminal, frames one after another otherwise. A failed read is said in its frame; the
    watch goes on."""
    drawn = 0
    while frames is None or drawn < frames:
        started = time.monotonic()
        try:
            body = shown()
        except (redis.RedisError, DecisionQueueError) as error:
            body = f"cannot read the queue: {type(error).__name__}: {error}\n"
        head = f"every {every:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)\n\n"
        out.write((CLEAR if out.isatty() else ("\n" if drawn else "")) + head + body)
        out.flush()
        drawn += 1
        if frames is None or drawn < frames:
            time.sleep(max(0.0, every - (time.monotonic() - started)))


def _table(headers: list[str], rows: list[list[str]], numeric_from: int) -> list[str]:
    """Columns as wide as their widest cell; text to the left, figures (from column ``numeric_from``) to the right."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(width) if index >= numeric_from else cell.ljust(width)
                         for index, (cell, width) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), *(line(row) for row in rows)]


def _figure(value: Any) -> str:
    """A count; ``-`` where there is none (no consumer group on the stream yet)."""
    return "-" if value is None else str(value)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)[:40]
