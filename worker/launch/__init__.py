"""``dq-worker serve --gpus``: one worker process per device, started and supervised (launcher.py), from what
the host has (host.py). They supervise workers rather than being one."""
