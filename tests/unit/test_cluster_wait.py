"""Durable mode's bookkeeping without a server: on Redis Cluster (producer/plumbing/cluster_wait.py) which commands
each primary's pipeline sends, and what the replies say per call; on one Redis (producer/plumbing/durable.py) the
pipeline and what its WAIT confirmed. A stand-in routes keys by slot range as a cluster client's slot map does; the
exchanges themselves are tested on real servers (tests/redis/test_cluster.py, tests/redis/test_failover.py,
tests/redis/test_client.py)."""

from dataclasses import dataclass

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, MovedError, RedisClusterException, TryAgainError

from producer.plumbing import cluster_wait, durable
from producer.plumbing.cluster_wait import MARK_TTL_MS, Confirmed, plan, settle
from producer.plumbing.commands import Command, command, fcall
from producer.wire.keys import Keys, hash_tag


@dataclass(frozen=True)
class Node:
    name: str


class SlotMap:
    """Three primaries, a third of the slots each: what ``get_node_from_key`` answers."""

    nodes = [Node("a:1"), Node("b:2"), Node("c:3")]

    def get_node_from_key(self, key: str) -> Node:
        return self.nodes[min(key_slot(key.encode()) * 3 // 16384, 2)]


def results(*ids: str) -> list[Command]:
    return [command("XRANGE", Keys().result(i), "-", "+", "COUNT", 1) for i in ids]


def spread() -> list[str]:
    """Ids whose results land on each of the three primaries, two each, in an interleaved order."""
    by_node: dict[str, list[str]] = {}
    for number in range(200):
        by_node.setdefault(SlotMap().get_node_from_key(Keys().result(f"r{number}")).name, []).append(f"r{number}")
    return [ids[k] for k in range(2) for ids in by_node.values()]


def test_a_read_mark_shares_its_slot_with_what_it_confirms():
    keys = Keys("prod")
    for request_id in ("a", "ticket-42", "x" * 128, "1:2.3_4-5"):
        assert key_slot(keys.durable_mark(keys.result(request_id)).encode()) == key_slot(keys.result(request_id)
                                                                                         .encode())
    assert hash_tag("dq:v1:{s3}:requests") == "s3" and hash_tag("no-tag") == "no-tag" and hash_tag("a{}b") == "a{}b"
    assert keys.durable_mark("load-7") == "prod:v1:durable:{load-7}"


def test_each_primary_gets_its_calls_in_order_then_a_mark_and_its_wait():
    ids = spread()
    calls = results(*ids)
    batches = plan(SlotMap(), calls, 1, 2000, Keys())
    assert len(batches) == 3
    for batch in batches:
        assert [calls[i].words for i in batch.indexes] == batch.commands[:-2]  # in the callers' order
        assert {SlotMap().get_node_from_key(calls[i].key) for i in batch.indexes} == {batch.node}
        mark = batch.commands[-2]
        assert mark[:3] == ("SET", Keys().durable_mark(calls[batch.indexes[0]].key), "") and \
            mark[3:] == ("PX", MARK_TTL_MS)
        assert SlotMap().get_node_from_key(mark[1]) == batch.node
        assert batch.commands[-1] == ("WAIT", 1, 2000)
    assert sorted(i for batch in batches for i in batch.indexes) == list(range(len(ids)))
    writes = plan(SlotMap(), [fcall("dq_v1_submit", ["dq:v1:{s0}:requests"], [0, "id", "{}"])], 2)
    assert writes[0].commands == [("FCALL", "dq_v1_submit", 1, "dq:v1:{s0}:requests", 0, "id", "{}"),
                                  ("WAIT", 2, cluster_wait.WAIT_MS)]  # a write is its own confirmation


def test_each_call_gets_the_count_of_its_own_primary():
    ids = spread()
    batches = plan(SlotMap(), results(*ids), 1, 2000, Keys())
    counts = {"a:1": 1, "b:2": 0, "c:3": 1}
    refusal = redis.ResponseError("NOPERM")
    outputs = []
    for batch in batches:
        replies: list = [[("1-0", {b"body": b"{}"})] for _ in batch.indexes]
        if batch.node.name == "c:3":
            replies[0] = refusal  # a refusal counts for nothing, the rest of its node still does
        outputs.append([*replies, True, counts[batch.node.name]])
    confirmed, doubt = settle(len(ids), batches, outputs, marked=True)
    assert doubt is None
    for batch in batches:
        for position, index in enumerate(batch.indexes):
            refused = batch.node.name == "c:3" and position == 0
            assert confirmed.replicas[index] == (0 if refused else counts[batch.node.name])
            assert (confirmed.replies[index] is refusal) == refused
    assert confirmed.fewest() == 0
    assert Confirmed([refusal], [0]).fewest() is None and Confirmed([1, 2], [2, 1]).fewest() == 1


def test_a_failed_mark_leaves_its_node_unconfirmed_and_a_doubt_is_reported():
    ids = spread()[:3]  # one per primary
    batches = plan(SlotMap(), results(*ids), 1, 2000, Keys())
    outputs = [[[], redis.ResponseError("NOPERM this user has no permissions to access the key"), 1],
               [[], True, 1], [[], True, 1]]
    confirmed, doubt = settle(3, batches, outputs, marked=True)
    assert doubt is None and confirmed.replicas[batches[0].indexes[0]] == 0
    assert [confirmed.replicas[b.indexes[0]] for b in batches[1:]] == [1, 1]
    moved = MovedError("3999 127.0.0.1:7001")
    outputs[1] = [moved, True, 1]  # redirected: nothing ran there, and the WAIT on that connection means nothing
    _, doubt = settle(3, batches, outputs, marked=True)
    assert doubt is moved
    broken = redis.ConnectionError("Connection closed by server.")
    outputs[1] = [[], True, broken]  # the reply was lost with the connection: maybe written, maybe not
    _, doubt = settle(3, batches, outputs, marked=True)
    assert doubt is broken


class Doubting(SlotMap):
    """A slot map whose node answers every command with ``doubt`` (or raises it, as a broken connection does), or
    that has no node for the slot (``RedisClusterException``); counts the refreshes asked for."""

    def __init__(self, doubt: BaseException) -> None:
        self.doubt, self.refreshed, self.sent = doubt, 0, []
        self.nodes_manager = self

    def initialize(self) -> None:
        self.refreshed += 1

    def get_node_from_key(self, key: str) -> Node:
        if isinstance(self.doubt, RedisClusterException):
            raise self.doubt
        return super().get_node_from_key(key)

    def get_redis_connection(self, node: Node) -> "Doubting":
        return self

    def pipeline(self, transaction: bool) -> "Doubting":
        self.batch: list = []
        return self

    def execute_command(self, *command: object) -> None:
        self.sent.append(command)
        self.batch.append(command)

    def execute(self, raise_on_error: bool) -> list:
        if isinstance(self.doubt, redis.ConnectionError):
            raise self.doubt
        return [self.doubt] * (len(self.batch) - 1) + [1]  # the WAIT answers at once: it confirms nothing


@pytest.mark.parametrize("doubt, raised", [
    (MovedError("3999 127.0.0.1:7001"), TryAgainError),
    (RedisClusterException("no node for slot 3999"), ClusterDownError),
    (ClusterDownError("CLUSTERDOWN The cluster is down"), ClusterDownError),
    (redis.ConnectionError("refused"), redis.ConnectionError),
])
def test_a_lasting_doubt_is_sent_again_then_raised_as_what_callers_wait_out(doubt, raised):
    cluster = Doubting(doubt)
    with pytest.raises(raised):
        cluster_wait.run(cluster, results("a"), 1, attempts=3)  # type: ignore[arg-type]
    assert cluster.refreshed == 3  # the slot map asked for again after each doubt, for the caller's next call too
    if not isinstance(doubt, RedisClusterException):  # the whole batch each time, the WAIT with it
        assert [command[0] for command in cluster.sent] == ["XRANGE", "WAIT"] * 3


def test_one_redis_gets_the_batch_then_a_read_mark_and_its_wait_and_each_call_the_count():
    reads = durable.Durable(results("a", "b"), 1, Keys("prod"))
    words = [each.words for each in durable.pipeline(reads)]
    assert words[:2] == [call.words for call in reads.commands]
    assert words[2:] == [("PUBLISH", Keys("prod").durable(), ""), ("WAIT", 1, cluster_wait.WAIT_MS)]
    refusal = redis.ResponseError("NOPERM")
    sent = durable.confirmed(reads, [[("1-0", {})], refusal, 1, 0])
    assert sent.replies == [[("1-0", {})], refusal] and sent.replicas == [0, 0] and durable.short(reads, sent)
    write = durable.Durable([fcall("dq_v1_submit", ["dq:v1:{s0}:requests"], [0, "id", "{}"])], 2)
    assert [each.words[0] for each in durable.pipeline(write)] == ["FCALL", "WAIT"]  # a write confirms itself
    assert durable.confirmed(write, [[b"id"], 2]).replicas == [2] and not durable.short(write, Confirmed([[]], [2]))
    assert not durable.short(write, Confirmed([refusal], [0]))  # nothing went through: nothing to confirm
    demoted = redis.ResponseError("WAIT cannot be used with replica instances")
    with pytest.raises(redis.ResponseError, match="replica"):
        durable.confirmed(write, [[b"id"], demoted])
