"""The function library's revision moves with its code: every change of the Lua text gets a new REVISION, so that
a worker can tell an older library on a server from its own and replace it (producer/wire/library.py)."""

import hashlib

from producer.wire import library

# REVISION -> the first 16 hex digits of the SHA-256 of library.CODE at that revision. A change of the code without
# a new revision fails here: bump library.REVISION and add the new revision's line. Within protocol v1 a revision
# keeps every function's arguments and meaning (it may add functions and optional trailing arguments).
REVISIONS = {
    1: "551d18b9babcaca2",
    2: "92a0e75cffd7b6f0",  # publish_as, part_as, reply; the high lane's request stream (docs/PROTOCOL.md)
    3: "9d0a1bb4ce5b0bbc",  # a reply stream's length capped: publish_as and reply take it last (optional)
    4: "f96d2f6239a69e1b",  # dead_letter (a dead letter with its result, one step), requeue; records, cancel
    5: "d9d9fd976f4a504c",  # a request sent again under a cancelled, unanswered one's id keeps the cancel mark
}


def test_each_revision_of_the_code_is_pinned():
    digest = hashlib.sha256(library.CODE.encode()).hexdigest()[:16]
    assert REVISIONS.get(library.REVISION) == digest, (
        f"producer/wire/functions.py CODE changed ({digest}): bump REVISION to {max(REVISIONS) + 1} and pin it here")
    assert library.REVISION == max(REVISIONS)


def test_names_carry_the_protocol_version():
    assert library.LIBRARY == "dq_v1" and library.CODE.startswith("#!lua name=dq_v1\n")
    for name in (library.SUBMIT, library.PUBLISH, library.PART, library.FORGET, library.REVISION_FUNCTION,
                 library.PUBLISH_AS, library.PART_AS, library.REPLY, library.DEAD_LETTER, library.REQUEUE,
                 library.CANCEL):
        assert name.startswith("dq_v1_") and f"'{name}'" in library.CODE
