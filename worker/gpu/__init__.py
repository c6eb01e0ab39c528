"""The GPU thread: prompts packed to the token budget (packer.py), packs run through the engine and read out
(compute.py)."""
