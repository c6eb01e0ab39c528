"""The Redis loop thread (asyncio), owner of every held entry: the thread itself, its parts and its coroutines
(thread.py); its calls to Redis (redis_calls.py), the consumer group (consumer.py), the readers and
maintenance (intake.py), an entry's life from taken to let go (lifecycle.py, held.py), the settle loop
(settler.py), publication (publisher.py), cancels (cancels.py) and the worker's heartbeat (presence.py)."""
