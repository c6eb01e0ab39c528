"""Free loopback ports for the servers and workers that the demo, the tests and the benchmarks start: below
the ephemeral range, never handed out twice by one process, and split between processes that pick side by
side."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

def free_port() -> int:
    """A port free on loopback now, below the ephemeral range (``free_ports``). One the kernel hands out for
    port 0 lies inside it, where another process's outgoing connection can take it before the server binds it:
    the tests, two processes side by side, once lost a Prometheus to that."""
    return free_ports(1)


# Ports this process handed out: a server stopped for a fault and started again on its port, or a worker that
# binds its metrics port seconds after, leaves one free for a while that is still promised (the CI once lost a
# worker so).
_handed_out: set[int] = set()


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on loopback now (a launcher's and its workers'), below
    the ephemeral range: a port found free there is not taken a moment later by some client's outgoing
    connection."""
    low, high = _share(10000, ephemeral_start())
    for _ in range(100):
        base = random.randrange(low, max(low + 1, high - count))  # the whole run inside this process's slice
        run = range(base, base + count)
        if _handed_out.intersection(run):  # free now, but maybe not for long (a server stopped to restart)
            continue
        try:
            for port in run:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:  # taken
            continue
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def ephemeral_start() -> int:
    """The first port the kernel may hand to an outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return 32768


def _share(low: int, high: int) -> tuple[int, int]:
    """This process's slice of [low, high) where ``DQ_PORT_SHARE=i/n`` says that n processes pick ports side
    by side (the test suite's, tests/conftest.py): a port one of them found free and has not bound yet (a
    worker process binds its metrics port seconds after) is then never handed to another."""
    share = os.environ.get("DQ_PORT_SHARE", "")
    try:
        index, count = (int(part) for part in share.split("/"))
    except ValueError:
        return low, high
    if not 0 <= index < count:
        return low, high
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width
