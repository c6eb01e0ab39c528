"""Which server binary runs: for now in server.py (the next commit moves it here)."""

from .server import Binary, embedded, find, find_binary, on_path, probe, servers_under_test  # noqa: F401
