"""Shared fixtures: tiny checkpoints written once per session, images, and the model loader."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import order
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ops/test.sh runs the suite in several processes (pytest-xdist: gw0, gw1, ...): each picks free ports from a slice of
# its own (producer/local/ports.py free_ports), inherited by the processes it starts.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.setdefault("DQ_PORT_SHARE", f"{os.environ['PYTEST_XDIST_WORKER'][2:]}/"
                                           f"{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}")
    # Each process computes (the in-process workers, the CPU engines) with its share of the cores, set before torch
    # is imported: with a thread per core in each, two processes on two cores spin against each other (OpenMP waits
    # busily), which made a 1 s test of the reference engine take 3 s beside one busy core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                     // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

TIMER = order.Timer()


def pytest_configure(config):
    """In several processes, whole modules in the order ``pytest_collection_modifyitems`` gives (tests/order.py):
    pytest-xdist would otherwise hand out the modules with the most tests first, whatever their seconds."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the processes collect; one process keeps the files' order
        items[:] = order.longest_first(items)


def pytest_runtest_logreport(report):
    TIMER.add(report.nodeid, report.duration)


def pytest_sessionfinish(session):
    if os.environ.get("DQ_TEST_SECONDS") and not hasattr(session.config, "workerinput"):  # the controller: all
        TIMER.write(os.environ["DQ_TEST_SECONDS"])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints in every format: name -> directory."""
    from worker.model import tiny

    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name, fmt, multimodal in [("repo", "repo", True), ("repo-text", "repo", False),
                                  ("readout", "readout", True), ("readout-text", "readout", False),
                                  ("judge", "judge", False)]:
        made[name] = tiny.write(root / name, fmt=fmt, multimodal=multimodal)
    return made


@pytest.fixture(scope="session")
def tiny_dir(checkpoints):
    return checkpoints["repo"]


@pytest.fixture(scope="session")
def loaded(checkpoints):
    """Loaded models, cached per (name, max_prompt_tokens)."""
    from worker.model import checkpoint

    cache = {}

    def get(name: str = "repo", max_prompt_tokens: int | None = None):
        key = (name, max_prompt_tokens)
        if key not in cache:
            cache[key] = checkpoint.load(checkpoints[name], device="cpu", max_prompt_tokens=max_prompt_tokens)
        return cache[key]

    return get
