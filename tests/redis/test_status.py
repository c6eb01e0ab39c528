"""Status through every state on a real server with worker processes (docs/PROTOCOL.md, "Status"): queued (lane,
how many ahead), in progress (which worker, since when, deliveries) also while the worker that holds it is dead,
answered, cancelled, dead-lettered, expired and unknown; one call for many ids, no payload read: the monitor user
asks it under its own ACL user without a single denial."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from faults import FAULTY
from ops.redis_acl import ROLES, render
from producer.client import Client
from producer.local.server import RedisServer
from producer.plumbing import library_loader
from producer.wire.keys import Keys
from test_cancel import request, until

pytestmark = [pytest.mark.redis, pytest.mark.slow]
KEYS = Keys()
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}


def test_status_through_every_state_with_a_worker_killed_while_holding_it(tmp_path: Path, start_worker, tiny_dir):
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS))
    with RedisServer("--aclfile", str(acl)) as server:
        as_role = {role: f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0" for role in ROLES}
        admin, client, monitor = redis.Redis.from_url(as_role["admin"]), Client(as_role["producer"]), \
            Client(as_role["monitor"])
        library_loader.ensure(admin)
        admin.acl_log_reset()

        # Queued, no worker yet: each lane's place in it, and an id never sent.
        client.submit_many([request(f"ahead-{i}") for i in range(3)] + [request("held"),
                            {**request("poison"), "state": "A POISON state."}])
        client.submit({**request("urgent"), "priority": "high"})
        found = monitor.status(["ahead-0", "held", "urgent", "never"])
        assert [found[r].state for r in found] == ["queued", "queued", "queued", "unknown"]
        assert (found["ahead-0"].ahead, found["held"].ahead, found["urgent"].ahead) == (0, 3, 0)
        assert found["held"].lane == "normal" and found["urgent"].lane == "high"

        # In progress: a worker whose packs take a minute holds them all; then it is killed holding them.
        doomed = start_worker(tiny_dir, as_role["worker"], entry=FAULTY, env={"DQ_FAULT_SLOW_S": "120"},
                              consumer="doomed")
        until(lambda: monitor.status("held")["held"].since_ms is not None, what="taken by the doomed worker")
        held = monitor.status("held")["held"]
        assert held.state == "in_progress" and held.worker == "doomed" and held.deliveries == 1
        assert abs(held.since_ms / 1000 - time.time()) < 60
        doomed.signal(signal.SIGKILL)
        doomed.wait(10)
        dead = monitor.status("held")["held"]
        assert dead.state == "in_progress" and dead.worker == "doomed" and dead.deliveries == 1  # still its, pending
        assert client.cancel("ahead-2")["ahead-2"].state == "cancelling"  # held by the dead one: the next decides

        # Another worker reclaims them: delivered twice, answered; the poison one dead-lettered; the cancelled one
        # answered `cancelled`, never computed; results kept 3 s.
        start_worker(tiny_dir, as_role["worker"], entry=FAULTY, env={"DQ_FAULT_RAISE": "POISON"},
                     consumer="heir", claim_idle_ms=500, max_deliveries=3, result_ttl_s=3)
        until(lambda: all(s.state != "in_progress" and s.status for s in monitor.status(
            ["ahead-0", "ahead-1", "ahead-2", "held", "poison", "urgent"]).values()), timeout=120, what="answers")
        final = monitor.status(["held", "ahead-2", "poison", "urgent"])
        assert final["held"].state == "answered" and final["held"].status == "ok" and final["held"].answered_ms
        assert final["ahead-2"].state == "cancelled" and final["ahead-2"].cancel_requested_ms
        assert final["poison"].state == "dead_lettered" and final["poison"].code == "dead_lettered"
        assert client.wait("held", timeout=10).usage is not None
        assert admin.xpending(KEYS.requests, KEYS.group)["pending"] == 0

        # dq-producer status, as the monitor: one line per id.
        shown = subprocess.run([sys.executable, "-m", "producer", "status", "held", "never", "--redis-url",
                                as_role["monitor"]], capture_output=True, text=True, timeout=60)
        lines = [json.loads(line) for line in shown.stdout.splitlines()]
        assert shown.returncode == 1 and [line["state"] for line in lines] == ["answered", "unknown"]

        # Expired: the record goes with its result (kept as long as the result, never a day past it): unknown.
        until(lambda: not admin.exists(KEYS.result("held")), timeout=30, what="the result's expiry")
        until(lambda: not admin.exists(KEYS.record("held")), timeout=5, what="the record's expiry")
        assert monitor.status("held")["held"].state == "unknown" == monitor.status("never")["never"].state
        # No command of the workers, the producer or the monitor was refused along the way.
        assert admin.acl_log() == [], admin.acl_log()
