"""Waits that say why they may be long: ``submit --wait`` and ``result --wait`` with no live worker in the
namespace (none started, or a mistyped namespace) warn at once, as the producer ACL user; with one, they do not."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ops.redis_acl import ROLES, render
from producer.local.server import RedisServer
from producer.plumbing import library_loader
from producer.wire.keys import Keys

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}
REQUEST = json.dumps({"id": "w-1", "state": "x", "questions": {"q": {"type": "noul"}}})


def test_a_wait_with_no_live_worker_warns_at_once(tmp_path):
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS))
    (tmp_path / "in.jsonl").write_text(REQUEST + "\n")
    with RedisServer("--aclfile", str(acl)) as server:
        producer = f"redis://producer:{PASSWORDS['producer']}@127.0.0.1:{server.port}/0"

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "producer", *args, "--redis-url", producer],
                                  capture_output=True, text=True, timeout=60, cwd=ROOT, env=os.environ)

        admin = redis.Redis.from_url(f"redis://admin:{PASSWORDS['admin']}@127.0.0.1:{server.port}/0")
        library_loader.ensure(admin)
        warning = "dq-producer: no live worker in namespace 'dq' (no heartbeat in the last 30 s"
        done = run("submit", str(tmp_path / "in.jsonl"), "--wait", "--timeout", "1", "--quiet")
        assert done.returncode == 1 and done.stderr.splitlines()[0].startswith(warning), done.stderr
        assert "waiting up to 1 s" in done.stderr.splitlines()[0]
        fetched = run("result", "w-1", "--wait", "1")
        assert fetched.returncode == 1 and fetched.stderr.startswith(warning), fetched.stderr
        admin.hset(Keys().workers(), "w-alive", json.dumps({"ts": time.time()}))  # a worker's heartbeat
        quiet = run("submit", str(tmp_path / "in.jsonl"), "--wait", "--timeout", "1", "--quiet")
        assert quiet.returncode == 1 and "no live worker" not in quiet.stderr, quiet.stderr
        assert admin.acl_log() == []
