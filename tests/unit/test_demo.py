"""The demo is never silent: setup says what it installs while pip runs quietly, and the demo says, before any
work and at the end, that its answers come from random weights."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_setup_says_what_it_installs(tmp_path):
    fake = tmp_path / "python"  # no torch yet, pip succeeds: both installs run
    fake.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 1\necho "$@" >> "$(dirname "$0")/calls"\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    done = subprocess.run(["bash", str(ROOT / "ops/setup.sh")], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHON": str(fake)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("setup: installing torch") and "a few minutes" in lines[0]
    assert lines[1].startswith("setup: installing decision-queue") and lines[-1] == "setup: installed"
    assert len((tmp_path / "calls").read_text().splitlines()) == 2


def test_the_demo_says_first_that_its_answers_come_from_random_weights(monkeypatch, capsys):
    import ops.demo as demo

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before the work")

    monkeypatch.setattr(demo.subprocess, "run", stop)
    with pytest.raises(RuntimeError):
        demo.main()
    first = capsys.readouterr().out.splitlines()[0]
    assert "RANDOM weights" in first and "arbitrary" in first
