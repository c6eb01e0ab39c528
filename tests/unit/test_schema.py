import json

import pytest

from producer.client.plans import InvalidRequest, prepare
from producer.wire.schema import ErrorCode, Request, RequestError, parse_request

from producer.wire.result import Result

GOOD = {"state": "hi", "questions": {"spam": {"type": "noul", "instructions": "Spam?"}}}


def body(**changes):
    return json.dumps({**GOOD, **changes})


def test_valid_request_round_trips_to_template_input():
    request = parse_request(body(id="r-1", deadline_ms=5))
    assert request.id == "r-1"
    assert request.template_input() == {"state": "hi", "questions": {"spam": {"type": "noul",
                                                                              "instructions": "Spam?"}}}


@pytest.mark.parametrize("raw, code", [
    (b"{not json", ErrorCode.INVALID_JSON),
    (b"[1, 2]", ErrorCode.INVALID_JSON),
    (b"\xff\xfe", ErrorCode.INVALID_JSON),
    (body().encode("utf-16"), ErrorCode.INVALID_JSON),  # UTF-8 only (json.loads alone would guess the encoding)
])
def test_malformed_bodies(raw, code):
    with pytest.raises(RequestError) as error:
        parse_request(raw)
    assert error.value.code == code


@pytest.mark.parametrize("questions, where", [
    ({"tone": {"type": "choice"}}, "questions.tone.criteria"),
    ({"tone": {"type": "choice", "criteria": {}}}, "questions.tone.criteria"),
    ({"lvl": {"type": "score", "criteria": "high"}}, "questions.lvl.criteria"),
    ({"x": {"type": "maybe"}}, "questions.x"),
    ({"x": {"type": "noul", "color": "red"}}, "questions.x.color"),
    ({"x": {"type": "noul", "criteria": {"perhaps": "no"}}}, "questions.x.criteria.perhaps"),
    ({}, "questions"),
])
def test_validation_errors_name_the_question(questions, where):
    with pytest.raises(RequestError) as error:
        parse_request(body(questions=questions))
    assert error.value.code == ErrorCode.INVALID_REQUEST
    assert where in error.value.message


def test_missing_state_and_wrong_types():
    with pytest.raises(RequestError, match="state"):
        parse_request(json.dumps({"questions": GOOD["questions"]}))
    with pytest.raises(RequestError, match="deadline_ms"):
        parse_request(body(deadline_ms="soon"))


def test_ids_reply_streams_and_assets_are_checked():
    with pytest.raises(RequestError, match="id must be"):
        parse_request(body(id="has {braces}"))
    with pytest.raises(RequestError, match="reply_to"):
        parse_request(body(reply_to="some:other:key"))
    # A path or URL instead of inline data is refused by the schema: no file or network access for producers.
    for asset in ("/etc/passwd", "http://example.com/a.png", {"url": "http://example.com/a.png"}):
        with pytest.raises(RequestError, match="assets.img-1"):
            parse_request(body(assets={"img-1": asset}))
    with pytest.raises(RequestError, match="format"):
        parse_request(body(assets={"img-1": {"format": "tiff", "data_base64": "AAAA"}}))


@pytest.mark.parametrize("request_id", ["x\n", "x" * 129, "", "a b", "a{b}", "1700000000000-0", "0-1", "1-1\n"])
def test_ids_are_matched_whole_and_entry_id_shapes_are_reserved(request_id):
    with pytest.raises(RequestError, match="id must be") as error:
        parse_request(body(id=request_id))
    assert error.value.code == ErrorCode.INVALID_REQUEST


def test_ids_at_the_limits_are_accepted():
    for request_id in ("x" * 128, "a", "1700000000000-0-1", "1700000000000", "-1", "1-", "a.b_c:d-e"):
        assert parse_request(body(id=request_id)).id == request_id


@pytest.mark.parametrize("reply_to", ["some:other:key", "dq:v1:reply:", "dq:v1:reply:a{b}", "dq:v1:reply:x\n",
                                      "dq:v1:result:{x:reply:y}", "dq:v1:reply:" + "x" * 129, "dq:v2:reply:x",
                                      "n s:v1:reply:x", "dq:v1:reply:a b"])
def test_reply_streams_have_one_shape(reply_to):
    with pytest.raises(RequestError, match="reply_to must be"):
        parse_request(body(reply_to=reply_to))


def test_error_results_are_bounded_whatever_the_request():
    """Thousands of invalid questions: the message names the first few and counts the rest."""
    many = {f"q{i}": {"type": "bogus"} for i in range(5000)}
    with pytest.raises(RequestError) as error:
        parse_request(body(questions=many))
    assert error.value.message.count("questions.q") == 10 and error.value.message.endswith("and 4990 more problems")
    result = Result.failure("r", ErrorCode.INVALID_REQUEST, "x" * 100_000)
    assert len(result.error.message) <= 2000 and result.error.message.endswith("(98040 more characters)")


def test_too_many_questions_and_options():
    many = {f"q{i}": {"type": "noul"} for i in range(65)}
    with pytest.raises(RequestError, match="questions"):
        parse_request(body(questions=many))
    options = {f"o{i}": None for i in range(27)}
    with pytest.raises(RequestError, match="questions.c.criteria"):
        parse_request(body(questions={"c": {"type": "choice", "criteria": options}}))


def test_lone_surrogates_are_invalid_unicode():
    with pytest.raises(RequestError, match="unicode") as error:
        parse_request('{"state": "bad \\ud800 text", "questions": {"q": {"type": "noul"}}}')
    assert error.value.code == ErrorCode.INVALID_REQUEST


def test_error_result_shape():
    result = Result.failure("r", ErrorCode.DEADLINE_EXCEEDED, "late")
    data = json.loads(result.model_dump_json(exclude_none=True))
    assert data == {"id": "r", "status": "error", "error": {"code": "deadline_exceeded", "message": "late"}}
    assert Request.model_validate(GOOD).reply_to is None


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_metadata_and_traceparent_are_accepted_and_checked():
    request = parse_request(body(metadata={"tenant": "acme", "tags": [1, None, {"a": "é"}]}, traceparent=TRACEPARENT))
    assert request.metadata == {"tenant": "acme", "tags": [1, None, {"a": "é"}]} and request.traceparent == TRACEPARENT
    assert parse_request(body(metadata={"k": "x" * 4000})).metadata  # under the cap
    assert parse_request(body(traceparent="01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-cafe"))
    cases = [
        ({"metadata": {"k": "x" * 4090}}, "metadata: Value error, metadata is 4098 bytes of JSON, over the 4096"),
        ({"metadata": ["not", "an", "object"]}, "metadata: Input should be a valid dictionary"),
        ({"metadata": "tenant=acme"}, "metadata: Input should be a valid dictionary"),
        ({"traceparent": TRACEPARENT.upper()}, "traceparent: Value error, traceparent must be a W3C trace context"),
        ({"traceparent": TRACEPARENT + "\n"}, "traceparent: Value error"),
        ({"traceparent": TRACEPARENT + "-00"}, "traceparent: Value error"),  # version 00 has exactly four fields
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, "traceparent: Value error"),
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01"}, "traceparent: Value error"),
        ({"traceparent": "ff" + TRACEPARENT[2:]}, "traceparent: Value error"),
        ({"traceparent": 7}, "traceparent: Input should be a valid string"),
    ]
    for change, message in cases:
        with pytest.raises(RequestError) as error:
            parse_request(body(**change))
        assert error.value.code == ErrorCode.INVALID_REQUEST and error.value.message.startswith(message), change


def test_results_accept_fields_they_do_not_know_and_keep_them():
    """A newer worker may add fields anywhere in a result, and error codes: older producers still read it."""
    raw = json.dumps({"id": "r", "status": "error", "new_top": {"x": 1},
                      "error": {"code": "brand_new_code", "message": "m", "hint": "h"},
                      "usage": {"tokens": 3, "prompts": 1, "parts": 1, "cache_hits": 2},
                      "timings": {"queued_ms": 4, "finished_ms": 9}})
    result = Result.model_validate_json(raw)
    assert result.model_extra == {"new_top": {"x": 1}} and result.usage.model_extra == {"cache_hits": 2}
    assert result.timings.finished_ms == 9 and result.timings.model_extra == {"queued_ms": 4}
    assert result.error.code == "brand_new_code" and result.error.model_extra == {"hint": "h"}
    assert json.loads(result.model_dump_json(exclude_none=True)) == json.loads(raw)  # written out again as read
    known = Result.model_validate_json(json.dumps({"id": "r", "status": "error",
                                                   "error": {"code": "too_large", "message": "m"}}))
    assert known.error.code is ErrorCode.TOO_LARGE


def test_ok_raise_for_error_and_probabilities_by_option():
    from producer.wire.result import ResultError

    result = Result(id="r", status="ok", answers={"tone": {}}, probabilities={"tone": [0.75, 0.25], "spam": [0.5, 0.5]},
                    options={"tone": ["calm", "angry"], "spam": ["true", "false"]})
    assert result.ok and result.raise_for_error() is result
    assert result.option_probabilities == {"tone": {"calm": 0.75, "angry": 0.25}, "spam": {"true": 0.5, "false": 0.5}}
    assert result.probabilities["tone"] == [0.75, 0.25]  # the lists stay
    failed = Result.failure("r-9", ErrorCode.STATE_TOO_LONG, "needs 9000 tokens, the model reads 8192")
    assert not failed.ok
    with pytest.raises(ResultError, match="request r-9: state_too_long: needs 9000 tokens") as error:
        failed.raise_for_error()
    assert error.value.code is ErrorCode.STATE_TOO_LONG and error.value.result is failed
    with pytest.raises(ResultError):
        failed.option_probabilities


def test_priority_is_high_or_normal_and_names_a_lane_stream():
    from producer.client.plans import prepare
    from producer.wire.keys import HIGH, NORMAL, Keys

    base = {"state": "x", "questions": {"q": {"type": "noul"}}}
    assert prepare({**base, "priority": "high"}).lane == HIGH
    assert prepare(base).lane == NORMAL and prepare({**base, "priority": "normal"}).lane == NORMAL
    for bad in ("urgent", "HIGH", 1):
        with pytest.raises(RequestError) as error:
            parse_request(json.dumps({**base, "priority": bad}))
        assert error.value.code == ErrorCode.INVALID_REQUEST and error.value.message.startswith("priority:")
    keys = Keys("ns", 3)
    assert keys.requests_in(HIGH) == "ns:v1:{s3}:requests:high" and keys.requests_in(NORMAL) == keys.requests
    assert keys.parts_in(HIGH) == "ns:v1:{s3}:chunks:high" and keys.parts_in(NORMAL) == keys.parts


@pytest.mark.parametrize("raw, problem", [
    ('{"state": NaN, "questions": {"q": {"type": "noul"}}}', "numbers must be finite"),
    ('{"state": {"a": [1, -Infinity]}, "questions": {"q": {"type": "noul"}}}', "numbers must be finite"),
    ('{"state": 1e400, "questions": {"q": {"type": "noul"}}}', "numbers must be finite"),
    ('{"state": "x", "metadata": {"v": 1e400}, "questions": {"q": {"type": "noul"}}}', "numbers must be finite"),
    ('{"state": "x", "questions": {"q": {"type": "noul", "instructions": [1e400]}}}', "numbers must be finite"),
    ('{"state": "x", "questions": {"q": {"type": "score", "criteria": [Infinity, "b"]}}}', "must be finite"),
    ('{"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a": -Infinity}}}}', "must be finite"),
    ('{"state": "x", "deadline_ms": true, "questions": {"q": {"type": "noul"}}}', "deadline_ms: Input should be"),
    ('{"state": "x", "deadline_ms": 1.5e12, "questions": {"q": {"type": "noul"}}}', "deadline_ms: Input should be"),
    ('{"state": "x", "deadline_ms": 1' + "0" * 400 + ', "questions": {"q": {"type": "noul"}}}', "less than or equal"),
])
def test_what_json_cannot_say_is_refused_not_changed(raw, problem):
    """NaN, the infinities and 1e400 were taken and written out again as null (the model read another request);
    a deadline of true was 1 ms after 1970, and one of 400 digits overflowed the gateway's wait after queueing."""
    with pytest.raises(RequestError) as refused:
        parse_request(raw)
    assert refused.value.code == ErrorCode.INVALID_REQUEST and problem in refused.value.message
    with pytest.raises(InvalidRequest, match=problem.split(":")[0]):
        prepare(json.loads(raw))
