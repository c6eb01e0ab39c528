"""dq-producer (``python -m producer``): main.py (the commands: submit, result, stats; the parser)
submission.py (what ``submit`` tracks: each input line, the report)  control.py (cancel, status)  table.py
(``stats`` as tables). The dead-letter and exporter commands are the operators' tools (producer/admin/). Exit
codes: plumbing/exits.py.
"""
