"""The local stack (ops/stack.py, ``bash ops/stack.sh``) as a new user meets it: started, it answers the README's
snippets as the README writes them (the Python client's, curl's, redis-cli's and the System One SDK's) and the
three commands it prints itself; a System One client with nothing changed but its base URL sends every kind of
image it can (the official SDK's five ways, and examples/node/systemone.mjs); a second stack on the same ports is
refused, naming the flag; Ctrl-C stops every part and removes what it made. The snippets run verbatim but for the
addresses: a test never takes 6379 or 8080, which a developer's own Redis or gateway may hold, so the stack runs on
free ports and the snippets' ``127.0.0.1:6379`` (the client's default, given as ``DQ_REDIS_URL``) and
``localhost:8080`` point there."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ops.stack import LAST
from producer.local.binaries import servers_under_test
from producer.local.ports import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIRST = servers_under_test()[0].label if servers_under_test() else None


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


class Stack:
    """``python ops/stack.py`` on free ports; what it printed once up."""

    def __init__(self) -> None:
        self.redis_port, self.gateway_port = free_port(), free_port()
        self.process = subprocess.Popen([sys.executable, "ops/stack.py", "--redis-port", str(self.redis_port),
                                         "--gateway-port", str(self.gateway_port)], cwd=ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def wait_up(self, timeout: float = 300) -> Stack:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(LAST) for line in self.lines):
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.1)
        return self

    def printed(self, prefix: str) -> list[str]:
        return [line.strip() for line in self.lines if line.strip().startswith(prefix)]

    def commands(self) -> list[str]:
        start = self.lines.index(next(line for line in self.lines if line.startswith("Try (")))
        end = self.lines.index("\n", start)
        return [line.strip() for line in self.lines[start + 1:end]]

    @property
    def gateway(self) -> str:
        return f"http://localhost:{self.gateway_port}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        code = self.process.wait(120)
        self.reader.join(10)
        return code


@pytest.fixture(scope="module")
def stack():
    started = Stack()
    try:
        yield started.wait_up()
    finally:
        started.stop()


@pytest.fixture
def up(request, server_binary):
    if server_binary.label != FIRST:
        pytest.skip("the stack runs whichever server is found; the snippets' answers do not depend on it: one run")
    return request.getfixturevalue("stack")


def shell(command: str, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done


def test_the_readme_python_snippet_runs_as_written(up):
    [snippet] = [block for block in blocks("python") if "from producer.client import Client" in block]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "DQ_REDIS_URL": up.url})
    assert done.returncode == 0, done.stderr
    first, *batch, status, cancel = done.stdout.splitlines()
    assert [0 <= float(p) <= 1 for p in first.split()] == [True, True]  # refund's noul, tone's calm
    assert [line.split()[0] for line in batch] == ["ticket-0", "ticket-1"]
    assert all(line.endswith("{'tenant': 'acme'}") for line in batch), batch
    assert "Status(" in status and "Cancel(" in cancel, (status, cancel)  # the last request's, then its cancel


def test_the_readme_curl_snippets_answer_as_written(up):
    [snippet] = [block for block in blocks("bash") if block.startswith("curl ")]
    decided, queued, fetched, where, cancelled = [
        json.loads(shell(line.replace("localhost:8080", f"localhost:{up.gateway_port}")).stdout)
        for line in snippet.splitlines()]
    assert decided["status"] == "ok" and set(decided["answers"]) == {"refund"}
    assert queued["ids"] == ["ticket-7"] and len(queued["digests"]) == 1
    assert fetched["id"] == "ticket-7" and fetched["status"] == "ok"
    assert where["state"] == "answered" and cancelled["state"] == "too_late"  # answered by then: too late to cancel


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli (Debian: apt-get install redis-tools)")
def test_the_readme_redis_cli_snippets_answer_as_written(up):
    [snippet] = [block for block in blocks("bash") if block.startswith("redis-cli ")]
    added, result = [shell(line.replace("redis-cli ", f"redis-cli -p {up.redis_port} ", 1)).stdout
                     for line in snippet.splitlines()]
    assert re.fullmatch(r"\d+-\d+\n", added), added
    fields = result.splitlines()  # the stream, the entry id, then field and value lines
    body = json.loads(fields[fields.index("body") + 1])
    assert body["id"] == "t-1" and body["status"] == "ok"


def png(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(out, "PNG")
    return out.getvalue()


def test_the_readme_system_one_snippet_runs_as_written(up, tmp_path):
    """The SDK's own defaults but for its base URL (the model jev-latest: the stack's alias), an image in the
    state: a multipart body, which a keyless gateway took only as JSON (415) before."""
    [snippet] = [block for block in blocks("python") if "from typesafe_sdk import" in block]
    (tmp_path / "photo.png").write_bytes(png((200, 30, 30)))
    done = subprocess.run([sys.executable, "-c", snippet.replace("localhost:8080", f"localhost:{up.gateway_port}")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "TYPESAFE_API_KEY": "any-value"})
    assert done.returncode == 0, done.stderr
    model, damaged, tone = done.stdout.split()
    assert model == "tiny-checkpoint" and 0 <= float(damaged) <= 1 and tone in ("calm", "angry")


def test_every_image_form_of_the_sdk_reaches_the_stack(up, monkeypatch):
    """The official SDK's five ways of sending an image (the state an image, attached and named in text, under a
    name of the call's own, in an object state, as choice criteria), each a multipart body, from a client made
    with its base URL alone (the key from its variable; the model its default, jev-latest)."""
    from typesafe_sdk import Choice, Image, Noul, TypeSafeClient

    monkeypatch.setenv("TYPESAFE_API_KEY", "any-value")
    red, blue = Image(png((200, 30, 30))), Image(png((30, 30, 200)))
    question = {"red": Noul(instructions="Is the picture red?")}
    with TypeSafeClient(base_url=up.gateway) as client:
        with client.attach_assets(red):
            attached = client.system_one(f"The parcel: {red}", question)
        answers = [client.system_one(red, question), attached,
                   client.system_one("Compare IMG_A with the text.", question, assets={"IMG_A": red}),
                   client.system_one({"photo": red, "note": "as delivered"}, question),
                   client.system_one("Which colour is the parcel?", {"colour": Choice(
                       criteria={"red": red, "blue": blue})})]
        names = {model.name for model in client.models.list().models}
    for response in answers:
        assert response.raw_http_response.request.headers["content-type"].startswith("multipart/form-data")
        assert response.model == "tiny-checkpoint" and len(response.answers) == 1
    assert answers[-1].answers["colour"].choice in ("red", "blue")
    assert names == {"tiny-checkpoint", "jev-latest"}
    assert up.printed("model    ") == ["model    tiny-checkpoint, also as jev-latest (the System One SDKs' default)"]


@pytest.mark.skipif(shutil.which("node") is None, reason="no node on PATH (Debian: apt-get install nodejs)")
def test_the_node_example_runs_on_the_stack_with_its_defaults(up):
    """examples/node/systemone.mjs with nothing but the stack's URL: JSON, gzip, multipart and inline images on the
    default model (its multipart call once ended in 'fetch failed': refused 415, the connection closed)."""
    done = subprocess.run(["node", str(ROOT / "examples/node/systemone.mjs"), "--url", up.gateway],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line["how"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert set(lines) == {"json", "gzip", "multipart", "base64", "models"}
    assert lines["multipart"]["body"]["model"] == "tiny-checkpoint"


def test_the_stack_says_where_everything_is_runs_what_it_prints_and_keeps_its_ports(up):
    assert up.printed("Redis    ") == [f"Redis    {up.url}   (export DQ_REDIS_URL={up.url} for the Python client)"]
    assert up.printed("gateway  ")[0].startswith(f"gateway  http://localhost:{up.gateway_port}")
    decide, submit, stats = up.commands()
    assert json.loads(shell(decide).stdout)["status"] == "ok"
    assert json.loads(shell(submit).stdout)["status"] == "ok"
    assert "1 worker live" in shell(stats).stdout
    # The redis-cli hint only where there is none.
    assert any(line.startswith("No redis-cli here?") for line in up.lines) == (shutil.which("redis-cli") is None)
    again = subprocess.run([sys.executable, "ops/stack.py", "--redis-port", str(up.redis_port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and f"port {up.redis_port} is taken" in again.stderr and "--redis-port" in \
        again.stderr
    keyless = subprocess.run([sys.executable, "ops/stack.py", "--api-keys-file", "/no/such/keys.json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert keyless.returncode == 2 and "no API keys file at /no/such/keys.json" in keyless.stderr


def listening(port: int) -> set[str]:
    """The addresses a socket listens on at ``port``, from /proc/net/tcp and tcp6 (IPv4 as dotted quads, IPv6 as
    hex)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return found


def test_every_part_listens_on_loopback_only(up):
    """The worker's endpoints (metrics, readiness) on 127.0.0.1 like Redis and the gateway: they listened on every
    interface, so anyone on the network could read the local stack's metrics."""
    worker = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", up.printed("worker   ")[0])
    for port in (up.redis_port, up.gateway_port, int(worker.group(1))):
        assert listening(port) and listening(port) <= {"127.0.0.1", "00000000000000000000000001000000"}, port


def test_ctrl_c_stops_every_part_and_removes_what_it_made(up):
    """Last: it stops the module's stack."""
    [logs] = up.printed("logs     ")
    work = Path(logs.split()[1])
    assert work.is_dir()
    assert up.stop() == 0, "".join(up.lines)
    assert not work.exists() and up.lines[-1] == "stack: stopping...\n"
    for port in (up.redis_port, up.gateway_port):  # every part gone: the ports are free again
        socket.create_server(("127.0.0.1", port)).close()
