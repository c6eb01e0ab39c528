"""A command started without its extra says which one to install and exits 2; ``--version`` needs none. Each runs in
a process of its own where the extra's modules cannot be imported (``sys.modules[name] = None`` makes an import
of it fail as a missing module does), as after a plain ``pip install -e .``: nothing is uninstalled."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WITHOUT = {"http": ["fastapi", "starlette", "uvicorn"], "worker": ["torch", "transformers", "prometheus_client"]}


def run(extra: str, module: str, *argv: str) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.modules.update(dict.fromkeys({WITHOUT[extra]!r})); from {module} import main; "
            f"sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("extra, module, argv, command", [
    ("http", "producer.gateway.__main__", ["--redis-url", "redis://127.0.0.1:1/0"], "dq-gateway"),
    ("worker", "worker.__main__", ["serve", "--checkpoint", "/nowhere"], "dq-worker serve"),
    ("worker", "worker.__main__", ["serve", "--gpus", "all", "--checkpoint", "/nowhere"], "dq-worker serve"),
    ("worker", "worker.__main__", ["tiny-checkpoint", "/nowhere"], "dq-worker tiny-checkpoint"),
    ("worker", "worker.__main__", ["check", "--metrics-port", "1"], "dq-worker check"),
])
def test_a_command_without_its_extra_names_it_and_exits_2(extra, module, argv, command):
    done = run(extra, module, *argv)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"{command}: needs the {extra} extra") and f"pip install 'decision-queue[{extra}]'" in line


@pytest.mark.parametrize("extra, module, name", [("http", "producer.gateway.__main__", "dq-gateway"),
                                                 ("worker", "worker.__main__", "dq-worker")])
def test_version_needs_no_extra(extra, module, name):
    done = run(extra, module, "--version")
    assert done.returncode == 0 and done.stdout.startswith(f"{name} "), done.stderr
