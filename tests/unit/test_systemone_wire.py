"""The System One wire on the gateway, without a server: bounded decompression (producer/gateway/systemone/decoding.py), the
multipart body, the call's checks and the answer's exact fields (producer/gateway/systemone/translate.py). The whole route,
driven by the official SDK against real processes: tests/redis/test_systemone.py."""

from __future__ import annotations

import gzip
import json

import pytest
from backports import zstd

from producer.gateway.front.replies import Refused
from producer.gateway.systemone import decoding, translate
from producer.wire.result import Result

LIMIT = 1 << 20


def test_a_zstd_bomb_is_never_inflated_past_the_limit():
    bomb = zstd.compress(b"\0" * (256 << 20))  # 256 MiB in a few kilobytes
    assert len(bomb) < 64 << 10
    decoder, out = decoding._Zstd(), 0
    for start in range(0, len(bomb), 4096):
        out += len(decoder.feed(bomb[start:start + 4096], LIMIT + 1 - out))
        if out > LIMIT:
            break
    assert out == LIMIT + 1  # one byte past the limit, and no more: the call is refused there


def test_zstd_frames_one_after_another_and_the_window_cap():
    decoder = decoding._Zstd()
    two = zstd.compress(b'{"a":') + zstd.compress(b" 1}")
    assert decoder.feed(two, LIMIT) == b'{"a": 1}' and decoder.complete()
    cut = decoding._Zstd()
    cut.feed(zstd.compress(b"x" * 5000)[:-4], LIMIT)
    assert not cut.complete()  # a body that ends mid-frame is refused, never half read
    wide = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: 27})
    frame = wide.compress(bytes(range(256)) * 4096, mode=wide.CONTINUE) + wide.flush()
    with pytest.raises(zstd.ZstdError):
        decoding._Zstd().feed(frame, LIMIT)  # a window over 8 MiB (RFC 9659): not this server's memory to give


def test_gzip_bombs_and_members():
    bomb = gzip.compress(b"\0" * (64 << 20))
    assert len(decoding._Gzip().feed(bomb, LIMIT + 1)) == LIMIT + 1
    decoder = decoding._Gzip()
    assert decoder.feed(gzip.compress(b"ab") + gzip.compress(b"cd"), LIMIT) == b"abcd" and decoder.complete()


def multipart(boundary: str, *parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_multipart_parts_by_name():
    body = multipart("b0b", ("request", None, b'{"x": 1}'), ("asset-0", "asset-0", b"\x89PNG\r\n\x1a\nrest"))
    parts = decoding.parts(body, {b"boundary": b"b0b"}, 17)
    assert bytes(parts["request"].data) == b'{"x": 1}' and parts["request"].filename is None
    assert bytes(parts["asset-0"].data) == b"\x89PNG\r\n\x1a\nrest" and parts["asset-0"].filename == "asset-0"
    for bad, why in [(multipart("b0b", ("a", None, b"1"), ("a", None, b"2")), "twice"),
                     (multipart("b0b", ("", None, b"1")), "name of its own"),
                     (multipart("b0b", *[(f"p{n}", None, b"") for n in range(3)]), "more than 2 parts")]:
        with pytest.raises(Refused, match=why):
            decoding.parts(bad, {b"boundary": b"b0b"}, 2)


def refused(call) -> Refused:
    with pytest.raises(Refused) as caught:
        call()
    return caught.value


def test_calls_are_checked_where_the_clients_would_not():
    call = {"model": "m", "state": "x", "questions": {"s": {"type": "score", "criteria": ["low", None, 3]}}}
    error = refused(lambda: translate.parse(json.dumps(call).encode()))
    assert error.status == 422 and [d["loc"] for d in error.extra["detail"]] == [
        ["body", "questions", "s", "criteria", 1], ["body", "questions", "s", "criteria", 2]]
    for state in (5, True, None):
        error = refused(lambda: translate.parse(json.dumps({**call, "state": state}).encode()))
        assert error.extra["detail"][0]["loc"] == ["body", "state"]
    box = translate.parse(json.dumps({**call, "questions": {"where": {"type": "box"}}}).encode())
    error = refused(lambda: translate.to_request(box, {}, "decider-a"))
    assert error.extra["detail"][0]["loc"] == ["body", "questions", "where", "type"] and "decider-a" in error.message
    extra = refused(lambda: translate.parse(json.dumps({**call, "questions": {"q": {"type": "noul"}},
                                                         "priority": "high"}).encode()))
    assert extra.extra["detail"][0]["loc"] == ["body", "priority"]


def test_images_from_parts_are_claimed_once_each():
    call = translate.parse(json.dumps({"model": "m", "state": "A: <img>", "questions": {"q": {"type": "noul"}},
                                       "assets": {"<img>": {"type": "image", "part": "p"}}}).encode())
    request = translate.to_request(call, {"p": decoding.Part("p", data=bytearray(b"\x89PNG"))}, "m")
    assert request.assets["<img>"].data_base64 == "iVBORw=="
    assert "not in the body" in refused(lambda: translate.to_request(call, {}, "m")).message
    unclaimed = {"p": decoding.Part("p", data=bytearray(b"1")), "q": decoding.Part("q", data=bytearray(b"2"))}
    assert "claimed by no asset: q" in refused(lambda: translate.to_request(call, unclaimed, "m")).message


def test_the_answer_has_exactly_the_clients_fields():
    result = Result.model_validate({
        "id": "r1", "status": "ok", "model": "decider-a", "usage": {"tokens": 42, "prompts": 1},
        "logits": {"q": [0.1, 0.2]}, "answers": {
            "q": {"type": "noul", "noul": 0.75, "extra": 1},
            "c": {"type": "choice", "choice": "calm", "confidence": 0.5, "probabilities": {"calm": 0.75, "angry": 0.25}},
            "s": {"type": "score", "score": 1.5, "confidence": 0.2, "legend": {"0": "low", "1": {"level": "high"}},
                  "probabilities": {"0": 0.5, "1": 0.5}}}})
    body = json.loads(translate.response(result, "alias"))
    assert body["model"] == "decider-a" and body["usage"] == {"input_tokens": 42, "output_tokens": 3}
    assert body["answers"]["q"] == {"type": "noul", "noul": 0.75}
    assert list(body["answers"]["s"]) == ["type", "score", "confidence", "legend", "probabilities"]
    assert json.loads(translate.error_body(422, "invalid_request", "bad", "questions.q")) == {
        "detail": [{"loc": ["body", "questions", "q"], "msg": "bad", "type": "invalid_request"}]}
    assert json.loads(translate.error_body(429, "too_many_in_flight", "wait")) == {
        "detail": {"error_type": "too_many_in_flight", "message": "wait"}}
