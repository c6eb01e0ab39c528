"""The demo is never silent: setup says what it installs while pip runs quietly, and the demo says, before any
work and at the end, that its answers come from random weights."""

import os
import stat
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_setup_says_what_it_installs(tmp_path):
    fake = tmp_path / "python"  # nothing installed, no torch yet, pip succeeds: both installs run
    fake.write_text('#!/bin/sh\ncase "$1" in -c|ops/installed.py) exit 1;; esac\n'
                    'echo "$@" >> "$(dirname "$0")/calls"\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    done = subprocess.run(["bash", str(ROOT / "ops/setup.sh")], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHON": str(fake)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("setup: installing torch") and "a few minutes" in lines[0]
    assert lines[1].startswith("setup: installing decision-queue") and lines[-1] == "setup: installed"
    assert len((tmp_path / "calls").read_text().splitlines()) == 2


def test_setup_runs_no_pip_where_everything_is_installed_and_pip_where_a_requirement_is_not():
    """Every start of the demo and the stack ran pip (10 of their 30 s): now only where pyproject.toml asks for
    what is not installed (this checkout is, editable: ops/test.sh installed it)."""
    import ops.installed as installed

    if installed.missing(["worker", "embedded", "http"]):
        pytest.skip(f"this checkout is not installed as ops/setup.sh installs it: {installed.missing(['worker'])}")
    done = subprocess.run(["bash", str(ROOT / "ops/setup.sh")], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0 and done.stderr.splitlines() == [
        "setup: decision-queue and its extras (worker,embedded,http) are installed as pyproject.toml asks: nothing "
        "to install"], done.stderr
    # A pyproject.toml that asks for more (a raised minimum, a new dependency) is pip's to install again.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    project["dependencies"] = [*project["dependencies"], "pydantic>=999", "nothing-by-this-name>=1"]
    assert sorted(installed.unmet(project, ["http"])) == ["nothing-by-this-name is not installed",
                                                          f"pydantic {version('pydantic')} is installed, not >=999"]


def test_the_demo_says_first_that_its_answers_come_from_random_weights_and_leaves_nothing_behind(
        monkeypatch, capsys, tmp_path):
    import ops.demo as demo

    made = []

    def stop(*args, **kwargs):
        made.extend(tmp_path.iterdir())
        raise KeyboardInterrupt()  # Ctrl-C while it writes the checkpoint

    monkeypatch.setattr(demo.subprocess, "run", stop)
    monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        demo.main()
    first = capsys.readouterr().out.splitlines()[0]
    assert "RANDOM weights" in first and "arbitrary" in first
    assert [path.name[:8] for path in made] == ["dq-demo-"] and list(tmp_path.iterdir()) == []  # its folder removed
