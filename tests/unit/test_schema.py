import json

import pytest

from producer.schema import ErrorCode, Request, RequestError, Result, parse_request

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
