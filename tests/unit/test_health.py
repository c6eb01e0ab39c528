"""Health decisions from the loops' heartbeats: stuck loops are dead, a reader waiting on Redis is only unready."""

import time

from worker.health import REDIS_GRACE_SECONDS, STALE_SECONDS, Snapshot, status


def daemon(reader_age: float, gpu_age: float = 0.0, reading_for: float | None = None, redis_ok: bool = True,
           loop_running: bool = True, library_ok: bool = True, present: bool = True) -> Snapshot:
    now = time.time()
    return Snapshot(beats={"reader": now - reader_age, "gpu": now - gpu_age},
                    reading_since=None if reading_for is None else now - reading_for, loop_running=loop_running,
                    redis_ok=redis_ok, library_ok=library_ok, ready=True, inflight=0, stopping=False, block_ms=1000,
                    present=present)


def test_turning_loops_are_live_and_ready():
    state = status(daemon(reader_age=0.5, reading_for=0.5))
    assert state["live"] and state["ready"] and state["redis"]


def test_a_reader_blocked_on_redis_past_the_stale_time_is_unready_not_dead():
    state = status(daemon(reader_age=STALE_SECONDS * 3, reading_for=STALE_SECONDS * 3))
    assert state["live"] and not state["ready"] and not state["redis"]
    # ... and unready as soon as a read outlasts its BLOCK time by the grace, before redis-py gives up.
    assert not status(daemon(reader_age=1.0 + REDIS_GRACE_SECONDS + 1, reading_for=1.0 + REDIS_GRACE_SECONDS + 1))[
        "ready"]


def test_a_stuck_loop_is_dead():
    assert status(daemon(reader_age=STALE_SECONDS + 5))["stuck"] == ["reader"]  # stale and not waiting on Redis
    state = status(daemon(reader_age=0.1, gpu_age=STALE_SECONDS + 5, reading_for=0.1))
    assert not state["live"] and state["stuck"] == ["gpu"] and not state["ready"]


def test_a_worker_without_a_heartbeat_yet_is_unready_not_dead():
    """Producers route a call by model to the workers whose heartbeat names it: until the first one is written,
    a warm worker is not ready (the stack read no heartbeat right after /readyz answered 200)."""
    state = status(daemon(reader_age=0.1, present=False))
    assert state["live"] and not state["ready"] and not state["present"]


def test_redis_errors_make_it_unready():
    state = status(daemon(reader_age=0.1, redis_ok=False))
    assert state["live"] and not state["ready"]


def test_a_server_without_the_function_library_makes_it_unready_not_dead():
    state = status(daemon(reader_age=0.1, reading_for=0.1, library_ok=False))
    assert state["live"] and not state["ready"] and state["redis"] and state["library"] is False


def test_a_reader_whose_loop_died_mid_read_is_dead():
    state = status(daemon(reader_age=STALE_SECONDS + 5, reading_for=STALE_SECONDS + 5, loop_running=False))
    assert not state["live"] and state["stuck"] == ["reader"]


def test_held_work_that_settles_nothing_for_the_bound_is_unready_until_it_does():
    now = time.time()
    base = dict(beats={"reader": now, "gpu": now}, reading_since=None, loop_running=True, redis_ok=True, ready=True,
                library_ok=True,
                inflight=3, stopping=False, block_ms=1000, stall_s=10.0)
    waiting = status(Snapshot(**base, oldest_taken=now - 11, released_at=now - 30))
    assert waiting["stalled"] and not waiting["ready"] and waiting["live"]  # unready, not restarted
    assert status(Snapshot(**base, oldest_taken=now - 11, released_at=now - 9))["ready"]  # another entry settled
    assert status(Snapshot(**base, oldest_taken=now - 9, released_at=None))["ready"]  # taken lately
    assert status(Snapshot(**{**base, "inflight": 0}, oldest_taken=None, released_at=now - 99))["ready"]  # idle
    # One entry left behind while the others settle: its idle time is kept fresh, so no other worker ever takes it.
    left = status(Snapshot(**base, oldest_taken=now - 101, released_at=now - 1))
    assert left["stalled"] and not left["ready"] and left["live"]
    assert status(Snapshot(**base, oldest_taken=now - 99, released_at=now - 1))["ready"]


def test_redis_refusing_the_works_writes_makes_it_unready():
    now = time.time()
    state = status(Snapshot(beats={"reader": now, "gpu": now}, reading_since=None, loop_running=True, redis_ok=True,
                            library_ok=True,
                            ready=True, inflight=1, stopping=False, block_ms=1000, refusing=True))
    assert state["live"] and state["redis"] and state["refusing"] and not state["ready"]


def test_a_draining_worker_is_live_not_ready_and_names_its_process():
    """A draining worker said ready: a launcher restarted beside it took it for its own (docs/OPERATIONS.md)."""
    import dataclasses
    import os

    state = status(dataclasses.replace(daemon(reader_age=0.5), stopping=True))
    assert state["live"] and not state["ready"] and state["stopping"] and state["pid"] == os.getpid()
