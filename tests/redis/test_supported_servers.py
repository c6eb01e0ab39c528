"""The servers themselves: each one the tests run on says what its id says, and where a server cannot count the
group's lag (it answers NULL), the project still reports the true figure."""

import pytest
import redis

from producer.plumbing.supported import Server, check, lag_of
from producer.wire.keys import Keys

pytestmark = [pytest.mark.redis]


def test_each_server_is_checked_at_connect_as_what_its_test_id_says(redis_server, server_binary):
    found = check(redis.Redis.from_url(redis_server.url))
    assert found == server_binary.server == redis_server.server and found.supported
    assert isinstance(found, Server) and found.label in ("valkey-" + ".".join(map(str, found.version)),
                                                          "redis-" + ".".join(map(str, found.version)))


def test_the_lag_counts_undelivered_entries_when_the_server_answers_null(redis_server):
    keys = Keys()
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    for i in range(10):
        r.xadd(keys.requests, {"body": str(i)})
    taken = r.xreadgroup(keys.group, "w", {keys.requests: ">"}, count=4)[0][1]
    # Answered out of order, as workers do: the newest taken entry first (acknowledged and deleted).
    r.xack(keys.requests, keys.group, taken[-1][0])
    r.xdel(keys.requests, taken[-1][0])
    [group] = r.xinfo_groups(keys.requests)
    assert group["lag"] is None  # Redis 7 and Valkey cannot count it any more: read as 0, it would lie
    length = r.xlen(keys.requests)
    assert (length, group["pending"]) == (9, 3)
    undelivered = len(r.xreadgroup(keys.group, "count", {keys.requests: ">"}, count=100)[0][1])
    assert lag_of(length, group["pending"], group["lag"]) == undelivered == 6
    assert lag_of(9, 3, 4) == 4  # the server's own figure when it has one
