"""dq-gateway: the queue behind one HTTP endpoint, for services that have no Redis client or would rather not
learn the wire protocol (docs/GATEWAY.md), and for callers written against the System One API. It holds no
request between calls (a System One call's mapping to its request lives in Redis), so any number of replicas
run behind a load balancer. Torch-free; needs the ``http`` extra (FastAPI, uvicorn, prometheus-client).

__main__.py (the command)  config.py (the one settings object, API keys)  metrics.py  front/ (what runs
before a route)  service.py (what the routes call: a call's requests checked, submission, results as they
land, readiness)  batcher.py (concurrent submissions in one call); the queue's API: routes.py  bodies.py
(what the POST routes read)  cancels.py (cancel and status, hang-ups)  openapi.py (every route's responses)
pages.py (/docs and /redoc, their assets served here); systemone/ (the System One API).
"""
