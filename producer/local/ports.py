"""Free loopback ports: for now in server.py (the next commit moves them here)."""

from .server import _handed_out, _share, ephemeral_start, free_port, free_ports, random  # noqa: F401
