"""Hypothesis strategies for request entry bodies, valid and not: shared by the in-process fuzz test
(tests/unit/test_fuzz.py) and the end-to-end sample through a worker (tests/redis/test_bad_input.py)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

CONTROL = ["<|mark|>", "<|split|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>",
           "<|vision_end|>", "<|endoftext|>", "<think>", "</think>", "{{", "{%", "\x00", "\u202e", "\ud800"]

text = st.one_of(st.text(max_size=40), st.sampled_from(CONTROL),
                 st.lists(st.sampled_from(CONTROL + ["a", " ", "img-1"]), max_size=6).map("".join))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(text, inner, max_size=4)), max_leaves=12)


def question():
    noul = st.fixed_dictionaries({"type": st.just("noul")}, optional={
        "instructions": json_values, "criteria": st.dictionaries(st.sampled_from(["true", "false", "maybe"]),
                                                                 json_values, max_size=3)})
    choice = st.fixed_dictionaries({"type": st.just("choice"), "criteria": st.dictionaries(text, json_values,
                                                                                          max_size=30)},
                                   optional={"instructions": json_values})
    score = st.fixed_dictionaries({"type": st.just("score"), "criteria": st.lists(json_values, max_size=30)},
                                  optional={"instructions": json_values})
    odd = st.fixed_dictionaries({"type": st.one_of(text, st.integers(), st.none())},
                                optional={"criteria": json_values, "extra": json_values})
    return st.one_of(noul, choice, score, odd, json_values)


def asset():
    good = st.fixed_dictionaries({"data_base64": st.sampled_from(["iVBORw0KGgo=", "aGVsbG8=", "not base64!"])},
                                 optional={"type": st.sampled_from(["image", "video"]),
                                           "format": st.sampled_from(["png", "tiff", "svg", None])})
    refused = st.one_of(st.sampled_from(["/etc/passwd", "file:///etc/passwd", "http://127.0.0.1:1/x.png"]),
                        st.fixed_dictionaries({"type": st.just("image"),
                                               "url": st.just("http://127.0.0.1:1/x.png")}),
                        st.fixed_dictionaries({"type": st.just("image"), "path": st.just("/etc/hostname")}))
    return st.one_of(good, refused, json_values)


requests = st.fixed_dictionaries(
    {"state": json_values, "questions": st.one_of(st.dictionaries(text, question(), max_size=5),
                                                  st.dictionaries(text, question(), min_size=60, max_size=70),
                                                  json_values)},
    optional={"id": st.one_of(st.text(max_size=10), st.integers(), st.just("a{b}")),
              "assets": st.one_of(st.dictionaries(st.sampled_from(["img-1", "x", "img-2"]), asset(), max_size=2),
                                  json_values),
              "reply_to": st.one_of(text, st.just("dq:v1:reply:fuzz")),
              "deadline_ms": st.one_of(st.integers(), st.floats(), text),
              "extra": json_values})


def _deep(depth: int, opener: str) -> str:
    inner = ('{"a": ' * depth + "1" + "}" * depth) if opener == "{" else ("[" * depth + "]" * depth)
    return json.dumps({"state": "PLACEHOLDER", "questions": {"q": {"type": "noul"}}}).replace('"PLACEHOLDER"', inner)


def _dumps(value) -> str:
    try:
        return json.dumps(value, allow_nan=True)
    except (ValueError, TypeError):
        return "{}"


bodies = st.one_of(
    requests.map(_dumps),
    json_values.map(_dumps),
    st.tuples(requests.map(_dumps), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),  # truncated
    st.binary(max_size=60),  # not even UTF-8
    # nested deeply: past the template's recursion (~150 levels here), pydantic's limit, json's (~1000)
    st.tuples(st.one_of(st.integers(50, 400), st.integers(900, 5000)), st.sampled_from("[{")).map(lambda t: _deep(*t)),
)
