"""``dq-worker load-functions`` as the admin sets a deployment up before any worker runs: the function library, and
every shard's work streams with the workers' group, so that an autoscaler polling them finds them (KEDA errors on
a missing stream or group, and some releases scale without bound: kedacore/keda#7447). Running it again is a no-op."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ops.redis_acl import ROLES, render
from producer.local.server import RedisServer
from producer.wire.keys import GROUP, LANES, Keys

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}


def test_setup_creates_every_shards_streams_and_group_before_any_worker(tmp_path):
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS, "shop"))  # the users of that namespace
    with RedisServer("--aclfile", str(acl)) as server:
        admin = f"redis://admin:{PASSWORDS['admin']}@127.0.0.1:{server.port}/0"

        def setup() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "worker", "load-functions", "--redis", admin,
                                   "--namespace", "shop", "--shards", "2"], capture_output=True, text=True,
                                  timeout=60, cwd=ROOT, env=os.environ)

        first = setup()
        assert first.returncode == 0, first.stderr
        assert "8 of 8 work streams' consumer group created" in first.stdout
        monitor = redis.Redis.from_url(f"redis://monitor:{PASSWORDS['monitor']}@127.0.0.1:{server.port}/0")
        for shard in (0, 1):
            keys = Keys("shop", shard)
            for stream in [name for lane in LANES for name in (keys.requests_in(lane), keys.parts_in(lane))]:
                [group] = monitor.xinfo_groups(stream)  # what KEDA reads, as KEDA's user
                assert group["name"] == GROUP.encode() and group["lag"] == 0, stream
        again = setup()
        assert again.returncode == 0 and "0 of 8 work streams' consumer group created" in again.stdout
