"""Which servers the project accepts (producer/plumbing/supported.py) and which one it runs (producer/local/binaries.py)."""

import os
import random
import socket
import stat
from types import SimpleNamespace

import pytest

from producer.local import binaries, ports, server
from producer.plumbing.supported import Server, UnsupportedServer, from_hello, require, supported


def test_hello_replies_in_both_protocols():
    resp3 = {b"server": b"valkey", b"version": b"9.1.2", b"proto": 3, b"mode": b"standalone"}
    resp2 = [b"server", b"redis", b"version", b"7.0.15", b"proto", 2]
    assert from_hello(resp3) == Server("valkey", (9, 1, 2)) and from_hello(resp2) == Server("redis", (7, 0, 15))
    assert str(from_hello(resp3)) == "Valkey 9.1.2" and from_hello(resp2).label == "redis-7.0.15"


@pytest.mark.parametrize("server, accepted", [
    (Server("redis", (6, 2, 14)), False), (Server("redis", (7, 0, 0)), True), (Server("redis", (8, 2)), True),
    (Server("valkey", (7, 2, 4)), True), (Server("valkey", (9, 1, 2)), True), (Server("keydb", (6, 3)), False),
])
def test_minimum_versions(server, accepted):
    assert server.supported is accepted
    if accepted:
        assert require(server) is server
    else:
        with pytest.raises(UnsupportedServer) as refused:
            require(server, "redis://127.0.0.1:6379/0")
        assert str(server) in str(refused.value) and supported() in str(refused.value)
        assert "redis://127.0.0.1:6379/0" in str(refused.value)


def fake_server(directory, version_line: str):
    """A file that answers ``--version`` only: for choosing between binaries, never run as a server."""
    directory.mkdir()
    path = directory / "redis-server"
    path.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_an_old_server_early_on_path_shadows_nothing(tmp_path, monkeypatch):
    embedded = binaries.embedded()
    assert embedded is not None and embedded.server.supported, "the embedded Valkey is a test dependency"
    old = fake_server(tmp_path / "venv-bin", "Redis server v=6.2.14 sha=00000000:0 malloc=libc bits=64")
    monkeypatch.delenv("DQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(old.parent))
    assert [b.server for b in binaries.on_path()] == [Server("redis", (6, 2, 14))]
    assert binaries.find() == embedded  # not the 6.2 that comes first
    newer = tmp_path / "system-bin"
    newer.mkdir()
    (newer / "redis-server").symlink_to(embedded.path)  # a supported system server, later on PATH
    monkeypatch.setenv("PATH", os.pathsep.join([str(old.parent), str(newer)]))
    chosen = binaries.find()
    assert chosen.server == embedded.server and not chosen.embedded  # the system's wins over the embedded one
    bundled = [b.label for b in [binaries.bundled_redis()] if b is not None]  # the test extra's Redis 8
    assert [b.label for b in binaries.servers_under_test()] == [embedded.label, *bundled]  # one per version
    monkeypatch.setenv("DQ_REDIS_SERVER", str(old))
    assert binaries.find().path == str(old)  # named explicitly: taken as it is (and refused at connect)


def test_the_tests_run_each_major_version_of_each_family_once(tmp_path, monkeypatch):
    """Debian's Redis 7.0 beside a Redis 8 on PATH: both run the tests (the newest of each major version), the
    embedded Valkey and the bundled Redis 8 first; the demo takes the newest."""
    paths = [fake_server(tmp_path / name, f"Redis server v={version} sha=00000000:0") for name, version in
             (("old7", "7.0.11"), ("new7", "7.0.15"), ("eight", "8.2.1"))]
    monkeypatch.delenv("DQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(str(p.parent) for p in paths))
    monkeypatch.setattr(binaries, "bundled_redis", lambda: binaries.probe(paths[2], embedded=True))
    assert [b.label for b in binaries.servers_under_test()] == [binaries.embedded().label, "redis-8.2.1",
                                                                 "redis-7.0.15"]
    assert binaries.find().label == "redis-8.2.1"
    monkeypatch.setattr(binaries, "bundled_redis", lambda: None)  # without the test extra: the system's alone
    assert [b.label for b in binaries.servers_under_test()][1:] == ["redis-7.0.15", "redis-8.2.1"]


def test_no_supported_server_is_a_clear_error(tmp_path, monkeypatch):
    old = fake_server(tmp_path / "bin", "Redis server v=6.2.14 sha=00000000:0")
    monkeypatch.delenv("DQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(old.parent))
    monkeypatch.setattr(binaries, "embedded", lambda: None)  # as without the embedded extra
    with pytest.raises(RuntimeError, match=r"no supported server \(Redis >= 7.0 or Valkey >= 7.2\): found Redis "
                                           r"6.2.14"):
        binaries.find()


def test_free_ports_lie_below_the_ephemeral_range_and_in_this_process_share(monkeypatch):
    ephemeral = ports.ephemeral_start()
    monkeypatch.setenv("DQ_PORT_SHARE", "1/2")
    low, high = ports._share(10000, ephemeral)
    assert low == 10000 + (ephemeral - 10000) // 2 and high <= ephemeral
    assert all(low <= ports.free_port() < high for _ in range(50))
    monkeypatch.setenv("DQ_PORT_SHARE", "0/2")
    assert all(10000 <= ports.free_port() < low for _ in range(50))
    assert all(base + 8 <= low for base in (ports.free_ports(8) for _ in range(50)))  # a run stays inside
    for malformed in ("", "2/2", "x", "1/0"):  # no slice: the whole range below the ephemeral ports
        monkeypatch.setenv("DQ_PORT_SHARE", malformed)
        assert ports._share(10000, 20000) == (10000, 20000)


def test_a_port_handed_out_is_not_handed_out_again_while_free(monkeypatch):
    """A worker binds its metrics port seconds after it was picked, and a server stopped for a fault binds its port
    again on restart: the port is free meanwhile, yet promised. The CI once lost a worker to the same port twice."""
    first = ports.free_port()  # nothing binds it: free, and handed out
    real, picks = random.Random(), iter([first, first])
    monkeypatch.setattr(ports.random, "randrange", lambda *args: next(picks, None) or real.randrange(*args))
    second = ports.free_port()
    assert second != first and second in ports._handed_out


def test_a_clusters_ports_and_bus_ports_are_distinct_free_and_in_this_process_share(monkeypatch):
    """A cluster node binds two ports: its own and its bus port (``cluster-port``). All of a cluster's ports are
    picked before any node binds one, so a random pick could repeat an earlier one: the node that bound it second
    failed with "Address already in use". Here every random pick comes twice, which makes such a repeat certain."""
    repeat: list[int] = []

    def each_twice(low: int, high: int) -> int:
        if repeat:
            return repeat.pop()
        repeat.append(random.randrange(low, high))
        return repeat[0]

    monkeypatch.setattr(ports, "random", SimpleNamespace(randrange=each_twice))
    low, high = ports._share(10000, ports.ephemeral_start())
    cluster = server.LocalCluster(3)
    try:
        taken = [node.port for node in cluster.nodes] + cluster.buses
        assert len(set(taken)) == 6 and all(low <= port < high for port in taken), taken
        for node, bus in zip(cluster.nodes, cluster.buses):
            assert node.args[node.args.index("--cluster-port") + 1] == str(bus)
        for port in taken:  # free now
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    finally:
        cluster.stop()  # removes the nodes' directories; none was started
