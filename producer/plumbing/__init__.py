"""The plumbing every role shares, torch-free, beside the contract and importing only it: connections to Redis
(connection.py: the deployment's settings, pools, TLS; sentinel.py: following a failover), durable mode on
Redis Cluster (cluster_wait.py: a WAIT per primary), the supported servers (supported.py, checked at connect),
the small HTTP server the workers and the exporter share (endpoints.py), the log formats (logs.py),
OpenTelemetry (traces.py, off unless configured), the commands' exit codes (exits.py) and the extras they
need (extras.py: a command started without its extra names it).
"""
