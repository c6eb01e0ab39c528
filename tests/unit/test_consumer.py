"""Entries deleted before the group read them, told from XINFO STREAM and XINFO GROUPS (worker/loop/consumer.py); the
shapes below are what Redis 7 and Valkey answer after each kind of deletion (tests/redis/test_ordinary_faults.py
makes the trim on real servers)."""

from worker.loop.consumer import entry_order, unread_deleted


def stream(length: int, first: str = "0-0", generated: str = "9-0", deleted: str = "0-0") -> dict:
    return {"length": length, "recorded-first-entry-id": first.encode(), "last-generated-id": generated.encode(),
            "max-deleted-entry-id": deleted.encode()}


def group(last: str, lag: int | None) -> dict:
    return {"name": b"workers", "last-delivered-id": last.encode(), "lag": lag}


def test_ids_sort_by_milliseconds_then_sequence():
    assert entry_order("10-0") > entry_order("9-5") > entry_order("9-4") and entry_order("7") == (7, 0)


def test_acknowledged_and_deleted_entries_are_not_a_loss():
    """A worker XDELs what it acknowledged: deleted ids stay at or below the last delivered one."""
    assert unread_deleted(stream(3, first="6-0", deleted="5-0"), group("5-0", 3)) is None
    assert unread_deleted(stream(0, generated="5-0", deleted="5-0"), group("5-0", 0)) is None  # all read, all gone


def test_an_unread_entry_deleted_by_id_is_seen():
    assert unread_deleted(stream(2, first="6-0", deleted="7-0"), group("5-0", 3)) == "7-0"


def test_a_trim_that_emptied_the_stream_is_seen():
    assert unread_deleted(stream(0, generated="9-0"), group("5-0", 0)) == "9-0"  # XADD MAXLEN 0, MINID far


def test_a_partial_trim_is_seen_by_the_lag_it_leaves_behind():
    assert unread_deleted(stream(4, first="8-0"), group("2-0", 9)) == "8-0"  # 9 to read, only 4 left
    assert unread_deleted(stream(4, first="3-0"), group("2-0", 4)) is None  # nothing unread gone
    assert unread_deleted(stream(4, first="8-0"), group("2-0", None)) is None  # no lag: not claimed either way
