"""What ``POST /v1/systemone`` reads before its JSON: a body compressed with ``Content-Encoding: zstd`` or
``gzip`` (the official clients compress bodies of 1 KiB and more with zstd), and a ``multipart/form-data``
body (a ``request`` JSON part, then one part per image, named by its asset entry).

A compressed body is inflated a chunk at a time, each step told how much output it may give: past the
gateway's body limit (the same one as a plain body's) the call is refused 413 at once, so a small body that
inflates to gigabytes never does in memory; and what it inflates to is charged to the gateway's body budget
before it is made (``--max-body-bytes-in-flight``: 503 busy where there is no room), as a plain body's length
is, so that forty 10 KB calls inflating to 7.5 MB each cannot take the gateway past its budget (they took it
from 62 MB to 1.3 GB). Windows are capped at 8 MiB (RFC 9659's limit for zstd over HTTP), which bounds a
decoder's own memory; concatenated frames and gzip members are read one after the other (empty and skippable
frames too, up to ``MAX_FRAMES``); a body that ends mid-frame is refused, never half read.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HttpRequest
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from ..front.replies import Refused

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

WINDOW_LOG_MAX = 23  # 8 MiB
MAX_FRAMES = 1000  # frames (or gzip members) in one body: each costs a decoder; the official clients send one
# The body budget charged as a body inflates, a step at a time: a small body costs 64 KiB while it inflates.
FIRST_STEP, LAST_STEP = 64 << 10, 1 << 20
ENCODINGS = ("zstd", "gzip", "x-gzip", "identity")


class _Zstd:
    """A zstd body's frames one after the other: what is left of the input after a frame (``unused_data``)
    starts the next, empty and skippable frames (RFC 8878) included."""

    def __init__(self) -> None:
        self.decoder, self.frames = self._new(), 1

    @staticmethod
    def _new() -> Any:
        return zstd.ZstdDecompressor(options={zstd.DecompressionParameter.window_log_max: WINDOW_LOG_MAX})

    def feed(self, data: bytes, room: int) -> bytes:
        """At most ``room`` bytes of output for ``data``; what it yields beyond is not made yet (the decoder
        keeps the input: the next call, with ``b""`` or more input, goes on from there)."""
        out = bytearray()
        while len(out) < room:
            if self.decoder.eof:  # a frame ended: the next one starts in what it left
                data = self.decoder.unused_data + data
                if not data:
                    break
                self.decoder, self.frames = self._new(), _counted(self.frames + 1)
            piece = self.decoder.decompress(data, max_length=room - len(out))
            data = b""
            out += piece
            if self.decoder.eof:
                continue  # an empty or skippable frame gives nothing: the next may
            if not piece or self.decoder.needs_input:
                break
        return bytes(out)

    def complete(self) -> bool:
        return bool(self.decoder.eof and not self.decoder.unused_data)


class _Gzip:
    """A gzip body's members one after the other; the input a call could not use yet (``unconsumed_tail``) is
    kept for the next."""

    def __init__(self) -> None:
        self.decoder, self.members, self.tail = zlib.decompressobj(16 + zlib.MAX_WBITS), 1, b""

    def feed(self, data: bytes, room: int) -> bytes:
        out, data, self.tail = bytearray(), self.tail + data, b""
        while len(out) < room:
            if self.decoder.eof:  # a member ended: another may follow
                data = self.decoder.unused_data + data
                if not data:
                    break
                self.members = _counted(self.members + 1)
                self.decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out += self.decoder.decompress(data, room - len(out))
            data = self.decoder.unconsumed_tail
            if not data and not self.decoder.eof:
                break
        self.tail = data
        return bytes(out)

    def complete(self) -> bool:
        return bool(self.decoder.eof and not self.decoder.unused_data and not self.tail)


def _counted(frames: int) -> int:
    if frames > MAX_FRAMES:
        raise Refused(400, "invalid_encoding", f"the body has more than {MAX_FRAMES} frames (or members)")
    return frames


async def body(http: HttpRequest, limit: int, charge: Callable[[int], None]) -> bytearray:
    """The body, decoded, held once (read from the stream, never kept by the request object too); 415 for an
    encoding other than zstd, gzip and identity, 413 once it passes ``limit`` bytes (sent or inflated), 400
    for a compressed body that is not what it says. A compressed body's inflated bytes are ``charge``d before
    they are made, a step at a time (from 64 KiB, doubling up to 1 MiB): where the gateway's body budget has
    no room the charge raises (503 busy), and nothing more is inflated."""
    encoding = http.headers.get("content-encoding", "identity").strip().lower() or "identity"
    if encoding not in ENCODINGS:
        raise Refused(415, "unsupported_encoding", f"Content-Encoding {encoding[:40]!r} is not taken: zstd, gzip or "
                      "none")
    out = bytearray()
    if encoding == "identity":
        async for chunk in http.stream():  # the front layer holds it to the limit, and charged its length
            out += chunk
        return out
    decoder = _Zstd() if encoding == "zstd" else _Gzip()
    charged, step = 0, FIRST_STEP
    try:
        async for chunk in http.stream():
            while True:  # this chunk's output, a charged step at a time
                if charged == len(out):
                    more = min(step, limit + 1 - charged)
                    charge(more)
                    charged, step = charged + more, min(2 * step, LAST_STEP)
                room = charged - len(out)
                piece = decoder.feed(chunk, room)
                chunk = b""
                out += piece
                if len(out) > limit:
                    raise Refused(413, "body_too_large", f"the body inflates past the {limit}-byte limit")
                if len(piece) < room:  # the input so far is used up
                    break
        complete = decoder.complete()
    except (zstd.ZstdError, zlib.error, EOFError) as error:
        raise Refused(400, "invalid_encoding", f"the body is not valid {encoding}: {str(error)[:200]}") from None
    if not complete:
        raise Refused(400, "invalid_encoding", f"the {encoding} body ends before its last frame does")
    return out


@dataclass
class Part:
    """One part of a multipart body: its name, file name and content type, as sent, and its bytes."""

    name: str = ""
    filename: str | None = None
    content_type: str = ""
    data: bytearray = field(default_factory=bytearray)


def media_type(http: HttpRequest) -> tuple[str, dict[bytes, bytes]]:
    """The body's media type (lower case) and its parameters."""
    kind, params = parse_options_header(http.headers.get("content-type", ""))
    return kind.decode("latin-1").lower(), params


def parts(body: bytes, params: dict[bytes, bytes], most: int) -> dict[str, Part]:
    """A multipart/form-data body's parts by name; 422 for a malformed body, a part without a name, a name given
    twice, or more than ``most`` parts."""
    boundary = params.get(b"boundary")
    if not boundary:
        raise Refused(422, "invalid_multipart", "multipart/form-data needs its boundary parameter")
    found: list[Part] = []
    header: list[bytes] = [b"", b""]
    headers: dict[bytes, bytes] = {}

    def begin() -> None:
        if len(found) >= most:
            raise Refused(422, "invalid_multipart", f"more than {most} parts")
        found.append(Part())
        headers.clear()

    def header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def header_end() -> None:
        headers[header[0].strip().lower()] = header[1].strip()
        header[0], header[1] = b"", b""

    def headers_done() -> None:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        part = found[-1]
        part.name = disposition.get(b"name", b"").decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        part.filename = filename.decode("utf-8", "replace") if filename is not None else None
        part.content_type = headers.get(b"content-type", b"").decode("latin-1")

    def data(chunk: bytes, start: int, end: int) -> None:
        found[-1].data += chunk[start:end]

    callbacks = {"on_part_begin": begin, "on_header_field": header_field, "on_header_value": header_value,
                 "on_header_end": header_end, "on_headers_finished": headers_done, "on_part_data": data}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except MultipartParseError as error:
        raise Refused(422, "invalid_multipart", f"the multipart body is malformed: {str(error)[:200]}") from None
    out: dict[str, Part] = {}
    for part in found:
        if not part.name or part.name in out:
            raise Refused(422, "invalid_multipart", "each part needs a name of its own (Content-Disposition: "
                          f"form-data; name=...), got {part.name[:80]!r}" + (" twice" if part.name else ""))
        out[part.name] = part
    return out
