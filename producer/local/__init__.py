"""A local Redis for development, torch-free: the server binary chosen (binaries.py), free loopback ports
(ports.py), and a server or a Redis Cluster started on them (server.py), for the demo, the tests and the
benchmarks. No worker stage imports it."""
