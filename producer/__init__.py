"""The decision-queue producer and wire contract: ``producer.client`` (Client, AsyncClient), ``producer.wire.schema``
(requests, error codes), ``producer.wire.result`` (results) and ``producer.wire.keys`` (every Redis name). Needs redis and
pydantic, not torch."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("decision-queue")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
