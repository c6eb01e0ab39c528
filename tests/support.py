"""Helpers shared by the test layers."""

from __future__ import annotations

import base64
import io


def png(color: str = "red", size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> str:
    """An inline image as a request asset carries it."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return base64.b64encode(buffer.getvalue()).decode()
