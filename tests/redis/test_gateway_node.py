"""Another language, proven: examples/node against the real stack (tests/redis/gateways.py). gateway.mjs speaks plain
HTTP to the gateway (Node alone); queue.mjs the Redis protocol through the function library (it needs the redis
package), sdk.mjs the System One API through the official Node SDK (@typesafe-ai/sdk), both installed by npm into a
temporary directory. Each skips, saying why, where its toolchain or a package is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from gateways import ROOT, TOKENS
from producer.local.binaries import servers_under_test
from producer.wire import library
from producer.wire.keys import HIGH, Field, Keys

EXAMPLE = ROOT / "examples" / "node"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="no node on PATH (Debian: apt-get install nodejs)")


@pytest.fixture(scope="session")
def node_modules(tmp_path_factory):
    """examples/node with its dependencies installed (npm install into a temporary directory), or a skip."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("no npm on PATH: queue.mjs needs the redis package, sdk.mjs @typesafe-ai/sdk (Debian: apt-get "
                    "install npm)")
    where = tmp_path_factory.mktemp("node-example")
    for name in ("package.json", "queue.mjs", "sdk.mjs"):
        shutil.copy(EXAMPLE / name, where / name)
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--no-package-lock", "--silent"], cwd=where,
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of the redis package and @typesafe-ai/sdk took over 180 s (no network?)")
    if done.returncode != 0:
        pytest.skip(f"npm install of the redis package and @typesafe-ai/sdk failed (no network?): "
                    f"{done.stderr.strip()[-300:]}")
    return where


def run(script: Path, *args: str, cwd: Path = ROOT) -> list[dict]:
    done = subprocess.run([NODE, str(script), *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line]


@needs_node
def test_node_through_the_gateway_with_plain_http(stack):
    results = run(EXAMPLE / "gateway.mjs", "--url", stack.gateway.url, "--token", TOKENS["acme"])
    assert len(results) == 4 and all(r["status"] == "ok" and r["metadata"] == {"from": "node-http"} for r in results)
    assert len({r["id"] for r in results}) == 4


@needs_node
def test_node_example_names_are_the_protocols():
    """queue.mjs spells the protocol's names itself (JavaScript cannot import keys.py): held to keys.py here."""
    for namespace, request_id in (("dq", "ticket-1"), ("acme.prod", "a:b.c-d_e")):
        [names] = run(EXAMPLE / "queue.mjs", "--names", namespace, request_id)
        keys = Keys(namespace)
        assert names == {"requests": keys.requests_in(HIGH), "result": keys.result(request_id),
                         "submit": library.SUBMIT, "body": Field.BODY}
    source = (EXAMPLE / "queue.mjs").read_text()
    assert "lane === 'high' ? ':high'" in source and Keys("X").requests.replace("X", "${namespace}") in source


@needs_node
def test_node_through_the_queue_with_the_function_library(stack, node_modules):
    results = run(node_modules / "queue.mjs", "--url", stack.server.url, cwd=node_modules)
    assert len(results) == 2 and all(r["status"] == "ok" and r["metadata"] == {"from": "node"} for r in results)


@needs_node
def test_the_official_node_sdk_through_the_gateway(request, server_binary):
    """@typesafe-ai/sdk (0.6.0) with its defaults but the base URL, the key and the model: every question type, an
    image inline, 20 calls at once, the model list, and a model nobody serves as its NotFoundError (sdk.mjs)."""
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("the SDK's side does not depend on the server: one run")
    stack, where = request.getfixturevalue("stack"), request.getfixturevalue("node_modules")
    [card] = httpx.get(stack.gateway.url + "/v1/models", headers={"Authorization": f"Bearer {TOKENS['acme']}"},
                       timeout=10).json()["models"]
    steps = {line["step"]: line for line in run(where / "sdk.mjs", "--url", stack.gateway.url, "--token",
                                                TOKENS["acme"], "--model", card["name"], cwd=where)}
    assert set(steps) == {"questions", "image", "concurrent", "models", "not_found"}
    assert all(step["ok"] for step in steps.values()), steps
    assert steps["questions"]["model"] == card["name"] and steps["concurrent"]["calls"] == 20
