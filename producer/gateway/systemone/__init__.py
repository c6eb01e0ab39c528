"""The System One API (POST /v1/systemone, GET /v1/models; docs/GATEWAY.md, "System One"): routes.py (its
routes, and its answers' shape registered with the front layer)  translate.py (its wire and the queue's)
decoding.py (compressed and multipart bodies)  models.py (routing by model)  retries.py (a client's retries of
a call answered by one request).
"""
