"""The order the test processes take modules in: the longest first, by their seconds in the last whole run
(tests/module_seconds.json), so that no long module starts last and runs alone at the end. pytest-xdist's
``--dist loadscope`` hands out whole modules in collection order (told not to reorder them by their count of
tests); a module not in the list runs first, its time unknown. No order changes a result (docs/TESTING.md).

    DQ_TEST_SECONDS=tests/module_seconds.json bash ops/test.sh     # a whole run writes each module's seconds
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

SECONDS = Path(__file__).resolve().with_name("module_seconds.json")


def module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list, seconds: dict[str, float] | None = None) -> list:
    """``items`` (pytest's, each with a ``nodeid``) module by module, the longest module first; within a module, as
    collected."""
    if seconds is None:
        seconds = json.loads(SECONDS.read_text()) if SECONDS.is_file() else {}
    by_module: dict[str, list] = defaultdict(list)
    for item in items:
        by_module[module(item.nodeid)].append(item)
    ordered = sorted(by_module, key=lambda name: -seconds.get(name, float("inf")))  # stable: ties as collected
    return [item for name in ordered for item in by_module[name]]


class Timer:
    """Sums each module's setup, call and teardown seconds as the reports come in; ``write`` merges them into
    the file named by ``DQ_TEST_SECONDS``, a module measured now replacing its earlier figure."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, nodeid: str, duration: float) -> None:
        self.seconds[module(nodeid)] += duration

    def write(self, path: str | os.PathLike) -> None:
        out = Path(path)
        merged = json.loads(out.read_text()) if out.is_file() else {}
        merged.update({name: round(value, 1) for name, value in self.seconds.items()})
        out.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))), indent=0) + "\n")
