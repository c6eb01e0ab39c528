"""Whether this checkout is installed as ops/setup.sh installs it, so that it can skip pip (about 10 s of every
start of the demo and the stack): decision-queue at pyproject.toml's version, editable from this directory, and
every requirement of the project and of the extras asked for (``python ops/installed.py worker,embedded,http``)
installed at a version its specifier allows, markers evaluated for this interpreter. Exit 0 when so; else 1,
saying on stderr what is missing. A changed pyproject.toml (a new dependency, a raised minimum) is missing
until pip installs it.
"""

from __future__ import annotations

import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requirement_class():  # packaging comes with pip (vendored) where it is not installed on its own
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def missing(extras: list[str]) -> list[str]:
    """What is not installed as asked, each as a short phrase; empty when everything is."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The installed one: a checkout on sys.path holds setuptools' egg-info too, which no installer wrote.
    installed = [dist for dist in metadata.distributions(name=project["name"]) if dist.read_text("direct_url.json")]
    if not installed:
        return [f"{project['name']} is not installed"]
    dist = installed[0]
    if dist.version != project["version"]:
        return [f"{project['name']} {dist.version} is installed, not {project['version']}"]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct.get("dir_info", {}).get("editable") or direct.get("url") != ROOT.as_uri():
        return [f"{project['name']} is not installed editable from {ROOT}"]
    return unmet(project, extras)


def unmet(project: dict, extras: list[str]) -> list[str]:
    """The requirements of ``project`` (pyproject.toml's table) and of its ``extras`` that are not installed at
    a version they allow."""
    requirement = _requirement_class()
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    out: list[str] = []
    seen: set[str] = set()
    while wanted:
        req = requirement(wanted.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == project["name"]:  # the test extra names others of the project's own
            wanted += [line for extra in req.extras for line in project["optional-dependencies"][extra]]
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} is installed, not {req.specifier}")
        for extra in sorted(req.extras - seen):  # its own extras' requirements (typesafe-sdk[zstd])
            seen.add(extra)
            for line in metadata.requires(req.name) or []:
                marker = requirement(line).marker
                if marker is not None and "extra" in str(marker) and marker.evaluate({"extra": extra}):
                    wanted.append(line)
    return out


def main(argv: list[str]) -> int:
    extras = [extra for extra in (argv[0] if argv else "").split(",") if extra]
    problems = missing(extras)
    for problem in problems:
        print(f"setup: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
