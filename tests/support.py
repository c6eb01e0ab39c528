"""Helpers shared by the test layers."""

from __future__ import annotations

import base64
import io
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
