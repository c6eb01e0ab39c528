"""The worker's spans of each request it answers (producer/plumbing/traces.py says when tracing is on, and the
trace): ``dq.process`` from enqueue to settled, parented by the ``traceparent`` the request (or part) carries,
and under it ``dq.queue_wait`` (enqueue to taken), ``dq.plan``, one ``dq.compute`` per pack its prompts ran in
(the pack's id, bucket and tokens) and ``dq.publish``.

The stages only note times here (a few floats per entry, and only while tracing is on); the spans are written
at once when the entry is settled, with the times noted, so no span is left open across threads. Notes of
entries let go another way (fanned out, retried, dead-lettered) are dropped, oldest first, past a bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from producer.plumbing import traces

from .entries import Delivery

NOTED = 100_000  # entries whose times are kept at most (an entry settled drops its own)


@dataclass
class Noted:
    """The times noted for one entry until its spans are written: its planning and its packs."""

    plan: tuple[float, float] | None = None
    # start, end, id, bucket,
    packs: list[tuple[float, float, int, int | None, int]] = field(default_factory=list)
    # tokens


class Traces:
    """Each answered request's spans, from times the stages note, written when it is settled."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.noted: OrderedDict[tuple[str, str], Noted] = OrderedDict()
        # the Redis loop notes plans and writes spans, the GPU thread notes packs
        self.lock = threading.Lock()
        self.packs = 0

    @classmethod
    def configured(cls) -> Traces | None:
        """Traces when tracing is on (producer/plumbing/traces.py), else None: the stages then note nothing."""
        tracer = traces.tracer("dq-worker") if traces.configure("dq-worker") else None
        return cls(tracer) if tracer is not None else None

    def _note(self, delivery: Delivery) -> Noted:
        key = (delivery.key, delivery.entry_id)
        noted = self.noted.get(key)
        if noted is None:
            noted = self.noted[key] = Noted()
            while len(self.noted) > NOTED:
                self.noted.popitem(last=False)
        return noted

    def planned(self, delivery: Delivery, start: float, end: float) -> None:
        with self.lock:
            self._note(delivery).plan = (start, end)

    def computed(self, deliveries: list[Delivery], start: float, end: float, bucket: int | None,
                 tokens: int) -> None:
        """One pack (the GPU thread): every delivery with a prompt in it."""
        with self.lock:
            self.packs += 1
            for delivery in deliveries:
                self._note(delivery).packs.append((start, end, self.packs, bucket, tokens))

    def settled(self, delivery: Delivery, request_id: str, traceparent: str | None, status: str | None,
                code: str | None, publish: tuple[float, float]) -> None:
        """Write the entry's spans (the Redis loop, once it is settled)."""
        with self.lock:
            noted = self.noted.pop((delivery.key, delivery.entry_id), None) or Noted()
        enqueued = delivery.enqueued_ms / 1000
        process = self.tracer.start_span("dq.process", context=traces.context_of(traceparent),
                                         kind=_kind("CONSUMER"),
                                         start_time=_ns(min(enqueued, delivery.taken)),
                                         attributes={"dq.request_id": request_id,
                                                     "dq.entry_id": delivery.entry_id,
                                                     "dq.stream": delivery.key, "dq.lane": str(delivery.lane),
                                                     "dq.deliveries": delivery.deliveries,
                                                     "dq.status": status or "share",
                                                     "dq.error.code": code or ""})
        from opentelemetry.trace import set_span_in_context

        inside = set_span_in_context(process)
        spans = [("dq.queue_wait", enqueued, delivery.taken, {})]
        if noted.plan:
            spans.append(("dq.plan", *noted.plan, {}))
        spans += [("dq.compute", start, end, {"dq.pack": pack, "dq.bucket": bucket or 0,
                                              "dq.pack_tokens": tokens})
                  for start, end, pack, bucket, tokens in noted.packs]
        spans.append(("dq.publish", *publish, {}))
        for name, start, end, attributes in spans:
            self.tracer.start_span(name, context=inside, start_time=_ns(start),
                                   attributes=attributes).end(end_time=_ns(max(start, end)))
        process.end(end_time=_ns(publish[1]))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _kind(name: str) -> Any:
    from opentelemetry.trace import SpanKind

    return getattr(SpanKind, name)
