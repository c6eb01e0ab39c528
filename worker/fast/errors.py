"""Why the fast engine cannot run here. Every message ends by naming the engine that can (``ALTERNATIVE``)."""

ALTERNATIVE = "run the reference engine instead (--engine reference, DQ_ENGINE=reference)"


class FastPathUnavailable(RuntimeError):
    """The fast engine cannot run here; the message says why and names the reference engine."""
