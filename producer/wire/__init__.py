"""The wire contract, torch-free, that every role imports, and that imports nothing else of the project: every
Redis name and entry field (keys.py), the request and its error codes (schema.py), what a request asks
(digest.py), the result (result.py), the errors (errors.py), the Redis Function library (library.py; its Lua
in functions.py) and a request's record (records.py: take, cancel, status)."""
