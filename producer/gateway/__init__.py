"""dq-gateway: the queue behind one HTTP endpoint, for services that have no Redis client or would rather not learn
the wire protocol (docs/GATEWAY.md), and for callers written against the System One API. It holds no request between
calls (a System One call's mapping to its request lives in Redis), so any number of replicas run behind a load
balancer. Torch-free; needs the ``http`` extra (FastAPI, uvicorn, prometheus-client).

config.py (the one settings object, API keys)  access.py (who may do what; in-flight limits)  routes.py (the routes)
service.py (what the routes call: a call's requests checked, submission, results as they land, readiness)
bodies.py (what the POST routes read)  batcher.py (concurrent submissions in one call)
connections.py (HTTP connections before a request reaches the app: head size and time, the connection cap)
front.py (the ASGI layer before the routes: authentication, admission, metrics)  admission.py (what a keyed call
takes before its body is read, and its body read within limits)  disconnects.py (a caller that hangs up: 499)
replies.py (errors as HTTP statuses)  cancels.py (cancel and status, hang-ups)  openapi.py (every route's
responses)  logs.py (its lines, CORS)  __main__.py (the command)
The System One API (POST /v1/systemone, GET /v1/models): systemone.py (its routes)  translate.py (its wire and the
queue's)  decoding.py (compressed and multipart bodies)  models.py (routing by model)  retries.py (a client's
retries of a call answered by one request)
"""
