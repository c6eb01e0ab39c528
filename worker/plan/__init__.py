"""The planners, beside the GPU (threads or processes): an entry's body parsed once, validated, rendered and
tokenized into a task (planner.py), the jobs handed out high lane first (pool.py)."""
