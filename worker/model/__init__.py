"""The model side: the engine contract (engine.py), the checkpoint, the encoder, the read-out and the
reference engine."""
