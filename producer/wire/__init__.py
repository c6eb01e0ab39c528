"""The wire contract, torch-free, that every role imports: every Redis name and entry field (keys.py), the request
and its error codes (schema.py), the result (result.py), the errors (errors.py), the Redis Function library
(library.py), connections (connection.py, sentinel.py), the supported servers (supported.py), and the small HTTP
server the workers and the exporter share (endpoints.py)."""
