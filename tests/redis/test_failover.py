"""Failover under load (docs/RELIABILITY.md, "Failover"): a primary, a replica and three sentinels on loopback, two
worker processes and producers with ids, all through a ``redis+sentinel://`` URL, in durable mode
(``--wait-replicas 1``); the primary is killed (-9), frozen past the sentinels' down-after time, and handed over
(``SENTINEL FAILOVER``), once each, and comes back as a replica. The same code as ops/failover.py, which runs 20 of
each kind with N = 0 and N = 1 and writes the table the docs quote."""

from __future__ import annotations

import json

import pytest

from ops.failover import KINDS, session
from producer.library import REVISION

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_durable_mode_loses_nothing_acknowledged_through_each_kind_of_failover(tiny_dir, tmp_path):
    [run] = session(tiny_dir, [("mixed", 1, len(KINDS))], logs=tmp_path, gap_s=0.5, settle_s=30.0)
    row = run.row()
    print("\nfailover:", json.dumps(row))
    assert len(run.failovers) == len(KINDS) and row["acked"] > 0 and row["read"] > 0, row
    # acknowledged and never answered, read and then lost or changed, left pending, workers exited or wedged
    assert (run.lost, run.read_lost, run.changed, run.pending, run.workers_down) == (0, 0, 0, 0, 0), row
    assert run.library == REVISION  # the promoted node had the library by replication
