"""The errors the producer raises, under one base (``DecisionQueueError``): the client's own here (the server
check's ``UnsupportedServer`` and the result's ``ResultError`` beside the code that raises them). Each keeps
its other base (``ValueError``, ``TimeoutError``, redis-py's ``ConnectionError``...), so code that caught
those still does. Torch-free and import-light: result.py builds on this module, never the other way round."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis


class DecisionQueueError(Exception):
    """Base of every decision-queue error: ``except DecisionQueueError`` catches each one the client raises."""


class RedisUnreachable(DecisionQueueError, redis.ConnectionError):
    """Redis did not answer the first contact (refused, unresolvable, or silent for the socket timeout):
    raised once, without the retries meant for a restarting server, naming the URL (password hidden) and the
    cause."""


class QueueFull(DecisionQueueError, RuntimeError):
    """Backpressure: a shard's stream holds more unfinished requests than the producer's limit.

    Each batch is all or nothing, and a call stops at the first refused batch: ``accepted`` are the ids
    enqueued before it (their results will come), ``refused`` the ids not enqueued (send them again later), in
    input order.
    """

    def __init__(self, detail: str, accepted: Sequence[str] = (), refused: Sequence[str] = ()) -> None:
        self.detail, self.accepted, self.refused = detail, list(accepted), list(refused)
        total = len(self.accepted) + len(self.refused)
        super().__init__(detail + (f"; {len(self.accepted)} of {total} requests accepted" if total else ""))


class InvalidRequest(DecisionQueueError, ValueError):
    """The request fails the wire schema; nothing was sent. ``index``: its position in a ``submit_many`` call."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"request {index}: {message}")
        self.index = index


class ResultTimeout(DecisionQueueError, TimeoutError):
    """No result within the timeout for ``missing`` (they stay queued; fetch them later); ``results``: those
    that did land, by id. ``no_worker``: the namespace, when no worker of it was alive for the whole wait (the
    message says so; the wait may have ended early for it), else None."""

    def __init__(self, message: str, results: Mapping[str, Any] | None = None,  # id -> Result
                 missing: Sequence[str] = (), no_worker: str | None = None) -> None:
        super().__init__(message)
        self.results, self.missing, self.no_worker = dict(results or {}), list(missing), no_worker


class ModelNotServed(DecisionQueueError, LookupError):
    """No live worker of the namespaces searched serves the model asked for (producer/client/served.py):
    ``model``, and ``served`` (the names that are served there)."""

    def __init__(self, model: str, served: Iterable[str], namespaces: Iterable[str]) -> None:
        self.model, self.served = model, sorted(served)
        super().__init__(f"no live worker serves the model {model!r} (namespaces {', '.join(namespaces)}); served: "
                         f"{', '.join(self.served) or 'none'}")


class WrongResult(DecisionQueueError, RuntimeError):
    """Kept for code that catches it; no longer raised: an entry that is no result of its id (another id's,
    garbage) is read as that id's ``id_conflict`` result (producer/wire/result.py ``read_stored``), so that
    one bad entry does not fail a whole read."""


class LibraryUnavailable(DecisionQueueError, RuntimeError):
    """The library is not on the server (or an older revision is), and this client's user may not load it."""


class NotDurable(DecisionQueueError, redis.ResponseError):
    """Durable mode (``wait_replicas``): fewer replicas than asked confirmed within the wait. ``ids``: the
    requests concerned. A submit: they are enqueued on the primary but may not survive a failover; submitting
    them again under the same ids is safe. A read: their results are not returned until replicas have them
    (wait again)."""

    def __init__(self, message: str, ids: Sequence[str] = (), replicas: int = 0, wanted: int = 0) -> None:
        super().__init__(message)
        self.ids, self.replicas, self.wanted = list(ids), replicas, wanted
