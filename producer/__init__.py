"""decision-queue's torch-free side: the wire contract every role imports (``producer.wire``: keys, schema,
result, errors, the function library, records), the plumbing every role shares (``producer.plumbing``:
connections, Sentinel, the supported servers, logs, traces), the Python client (``producer.client``: Client,
AsyncClient), dq-producer (``producer.cli``) and its admin tools (``producer.admin``), the HTTP gateway
(``producer.gateway``) and a local Redis for development (``producer.local``). Needs redis and pydantic (the
gateway: the ``http`` extra), never torch."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("decision-queue")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
