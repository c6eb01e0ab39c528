"""Which keys were written, by anyone, while a test ran: Redis' keyspace notifications, one event per write."""

from __future__ import annotations

import threading
import time

import redis


class WrittenKeys:
    """Watches every write event (``notify-keyspace-events EA``) from construction until ``stop``."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self.redis.config_set("notify-keyspace-events", "EA")
        self.events: list[tuple[str, bytes]] = []  # (event, key) in the order Redis sent them
        self.lock = threading.Lock()
        self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(**{"__keyevent@*__:*": self._on_event})
        while self.pubsub.get_message(timeout=1.0) is None and not self.pubsub.subscribed:
            pass
        self.thread = self.pubsub.run_in_thread(sleep_time=0.005, daemon=True)
        self._mark = b"__written_keys_mark__"  # a write of its own: everything before it has been seen
        self.sync()

    def _on_event(self, message: dict) -> None:
        event = message["channel"].decode().split(":", 1)[1]
        with self.lock:
            self.events.append((event, message["data"]))

    def sync(self, timeout: float = 10.0) -> None:
        """Until the events of every write made before this call have arrived."""
        self.redis.set(self._mark, b"1")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if any(key == self._mark for _, key in self.events):
                    self.events = [(event, key) for event, key in self.events if key != self._mark]
                    return
            time.sleep(0.01)
        raise TimeoutError("keyspace notifications did not arrive")

    def keys(self) -> set[bytes]:
        self.sync()
        with self.lock:
            return {key for _, key in self.events}

    def stop(self) -> None:
        self.thread.stop()  # it closes the subscription itself
        self.thread.join(5)
        self.redis.delete(self._mark)
        self.redis.close()
