"""The Redis loop thread (asyncio), owner of every held entry: its calls to Redis (redis_calls.py), the
consumer group (consumer.py), the readers and maintenance (intake.py), an entry's life from taken to let go
(lifecycle.py), publication (publisher.py) and the worker's heartbeat (presence.py)."""
