"""What runs before a route: connections.py (HTTP connections before a request reaches the app: head size and
time, the connection cap)  layer.py (the ASGI layer: authentication, admission, metrics, the call's span, its
access line)  access.py (who may do what; in-flight limits)  admission.py (what a keyed call takes before its
body is read, and its body read within limits)  replies.py (errors as HTTP statuses)  redis_failures.py (each
counted, an outage logged once)  disconnects.py (a caller that hangs up: 499)  logs.py (its lines, access
lines, CORS). It imports neither the client nor an API behind it: an API that answers in a shape of its own
registers it (``layer.Dialect``).
"""
