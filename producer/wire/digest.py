"""What a request asks, as 32 hex digits: the one place producers and workers compute it. Every result carries
its request's digest (error results too), and a result answers a request only when their digests match
(docs/PROTOCOL.md, "Reusing an id"): a later request under a used id is a replay of the first when it asks the
same, else an ``id_conflict``; a result without a digest, or one that cannot be read, answers no request.
"""

from __future__ import annotations

import hashlib

from .schema import Request

# What a request asks, not how it travels: a resubmission with another reply stream, deadline, lane or trace
# is the same request.
DIGESTED = {"state", "questions", "assets", "metadata"}


def digest(request: Request) -> str:
    """A valid request's digest: of its asked fields as the schema writes them."""
    return hashlib.sha256(request.model_dump_json(include=DIGESTED).encode()).hexdigest()[:32]


def body_digest(body: bytes | str) -> str:
    """The digest of a request body that did not validate (or was too large to read), of its bytes as sent:
    the same bytes sent again are the same request, anything else another. A prefix keeps it apart from
    ``digest``."""
    raw = body.encode() if isinstance(body, str) else body
    return hashlib.sha256(b"body\0" + raw).hexdigest()[:32]
