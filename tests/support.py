"""Helpers shared by the test layers."""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request


def png(color: str = "red", size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> str:
    """An inline image as a request asset carries it."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def http_get(url: str) -> tuple[int, str]:
    """GET as a probe does: the status and the body, an error status included."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def report(**figures: object) -> None:
    """A GPU test's measured figures: printed as a RESULT line, and appended as JSON to DQ_GPU_REPORT where set."""
    line = json.dumps(figures)
    print("RESULT", line)
    if os.environ.get("DQ_GPU_REPORT"):
        with open(os.environ["DQ_GPU_REPORT"], "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
