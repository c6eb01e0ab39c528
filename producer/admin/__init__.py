"""The operators' tools, torch-free: dead letters (dead_letters.py: ``dq-producer dead``), the queue exporter
(exporter.py: ``dq-producer exporter``) and the audit of the queue's promise from outside, exactly one result
per request (audit.py: the fault, bad-input and soak tests and ``ops/soak.py``)."""
