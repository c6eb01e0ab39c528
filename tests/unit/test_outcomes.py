"""How an entry ends, as plain data (worker/outcomes.py): a part's share survives its trip through Redis as JSON;
parts merge into one result in the request's question order, each counted once; error results go where the
request's identity says."""

from producer.wire.keys import Keys
from producer.wire.schema import ErrorCode
from worker.entries import REQUESTS, Delivery, Identity
from worker.outcomes import Outcome, Share, error_outcome, ok_result

KEYS = Keys("dq")
ME = Identity("r-1", KEYS.reply_prefix + "me", {"tenant": "acme"}, "00-" + "a" * 32 + "-" + "b" * 16 + "-01")


def share(names: list[str], tokens: int, started_ms: int) -> Share:
    return Share(answers={n: {"type": "noul", "noul": 0.5, "of": tokens} for n in names},
                 logits={n: [1.0, -1.0] for n in names}, probabilities={n: [0.5, 0.5] for n in names},
                 options={n: ["true", "false"] for n in names}, tokens=tokens, prompts=1, compute_ms=1.25,
                 started_ms=started_ms)


def delivery(n: int = 0) -> Delivery:
    return Delivery.parse(REQUESTS, KEYS.requests, f"1700000000000-{n}", {b"body": b'{"id": "r-1"}'}, 1)


def test_a_share_round_trips_through_json():
    one = share(["a", "b"], 12, 1000)
    assert Share.from_json(one.to_json()) == one


def test_parts_merge_in_the_requests_question_order_and_their_usage_adds_up():
    outcome = Outcome(delivery(), ME, share=share(["c"], 7, 2000), part=1, parts=2, order=["a", "b", "c"])
    outcome.merge([share(["c"], 7, 2000), share(["a", "b"], 10, 1500)], "tiny")
    result = outcome.result
    assert outcome.share is None and result.ok and list(result.answers) == ["a", "b", "c"]
    assert [result.answers[n]["of"] for n in "abc"] == [10, 10, 7]
    assert (result.usage.tokens, result.usage.prompts, result.usage.parts) == (17, 2, 2)
    assert result.timings.started_ms == 1500 and result.timings.compute_ms == 2.5
    assert (result.id, result.metadata, result.traceparent) == ("r-1", ME.metadata, ME.traceparent)


def test_an_error_result_answers_the_identity_not_the_entry():
    outcome = error_outcome(delivery(), ME, ErrorCode.DEAD_LETTERED, "gave up", "tiny")
    assert (outcome.request_id, outcome.reply_to) == ("r-1", ME.reply_to)
    assert outcome.result.error.code == ErrorCode.DEAD_LETTERED and outcome.result.metadata == ME.metadata
    assert outcome.publisher == f"{outcome.delivery.key} {outcome.delivery.entry_id} 1"


def test_a_whole_result_keeps_only_its_questions():
    result = ok_result(Identity("r-2"), [share(["a", "b"], 5, 1)], ["b"], 0, "tiny")
    assert list(result.answers) == ["b"] and result.metadata is None


def test_a_split_request_says_so_and_an_older_workers_share_still_loads():
    older = share(["a"], 3, 1).to_json().replace(', "split": false', "")
    assert '"split"' not in older and Share.from_json(older).split is False
    whole = ok_result(Identity("r-3"), [share(["a"], 3, 1)], ["a"], 0, "tiny")
    assert whole.usage.split is None and "split" not in whole.model_dump_json(exclude_none=True)
    split = Share(**{**share(["b"], 4, 2).__dict__, "split": True})
    assert ok_result(Identity("r-3"), [share(["a"], 3, 1), split], ["a", "b"], 0, "tiny").usage.split is True
