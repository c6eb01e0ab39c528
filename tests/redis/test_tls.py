"""TLS: a redis-server that speaks only TLS and wants client certificates; worker and producer over rediss://."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from producer.client import Client
from producer.local.server import RedisServer
from test_e2e import requests

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path) -> None:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=dq test CA", cwd=directory)
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=dq {name}", cwd=directory)
        (directory / f"{name}.ext").write_text(extension + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)


class TlsRedisServer(RedisServer):
    """TLS only (``port 0``), with client certificates."""

    def __init__(self, pki: Path) -> None:
        self.pki = pki
        super().__init__("--tls-port", "0", "--port", "0", "--tls-cert-file", str(pki / "server.pem"),
                         "--tls-key-file", str(pki / "server.key"), "--tls-ca-cert-file", str(pki / "ca.pem"),
                         "--tls-auth-clients", "yes")
        self.args[self.args.index("--tls-port") + 1] = str(self.port)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def tls(self, client_certificate: bool = True) -> dict[str, str]:
        options = {"ssl_ca_certs": str(self.pki / "ca.pem")}
        if client_certificate:
            options.update(ssl_certfile=str(self.pki / "client.pem"), ssl_keyfile=str(self.pki / "client.key"))
        return options

    def answers(self) -> bool:
        """Readiness is a TLS PING with the client certificate."""
        try:
            with redis.Redis.from_url(self.url, socket_timeout=1, **self.tls()) as probe:
                return bool(probe.ping())
        except redis.ConnectionError:
            return False


@pytest.fixture
def tls_server(tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("no openssl CLI to make certificates")
    make_pki(tmp_path)
    server = TlsRedisServer(tmp_path)
    try:
        server.start()
    except RuntimeError as error:
        server.__exit__()
        # built without TLS: Redis does not know tls-port, Valkey lacks the tls connection type
        if any(sign in str(error) for sign in ("Bad directive", "Failed finding TLS support")):
            pytest.skip(f"{server.server} built without TLS")
        raise
    yield server
    server.__exit__()


def test_worker_and_producer_over_tls_with_client_certificates(tls_server, start_worker, tiny_dir):
    # Plain TCP and TLS without a client certificate are both turned away.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=tls_server.port, socket_timeout=2, retry=None).ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(tls_server.url, socket_timeout=2, **tls_server.tls(client_certificate=False)).ping()

    pki = tls_server.pki
    worker = start_worker(tiny_dir, tls_server.url, redis_tls_ca=pki / "ca.pem", redis_tls_cert=pki / "client.pem",
                          redis_tls_key=pki / "client.key")
    # The producer takes the same files as URL parameters (any redis-py URL option works there).
    query = "&".join(f"{name}={path}" for name, path in tls_server.tls().items())
    client = Client(f"{tls_server.url}?{query}")
    ids = client.submit_many(requests(10, "tls"))
    results = client.wait_many(ids, timeout=60)
    assert all(results[r].ok for r in ids)
    # Counted once the acknowledgement is back, a moment after the result is readable.
    deadline = time.monotonic() + 10
    while worker.metric("dq_results_total", status="ok") < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.metric("dq_results_total", status="ok") == 10 and worker.metric("dq_redis_errors_total") == 0


def test_tls_files_with_a_plain_url_are_refused_at_start(start_worker, tiny_dir, tmp_path, redis_server):
    worker = start_worker(tiny_dir, redis_server.url, ready=False, redis_tls_ca=tmp_path / "ca.pem")
    assert worker.wait(60) == 2
    assert "rediss://" in worker.log.read_text()
