"""The gateway's settings and keys without a server: flags over variables over defaults, every value checked when
parsed, keys files that would open the gateway or leak a token refused, tokens matched in constant time."""

from __future__ import annotations

import json

import pytest

from producer.gateway.config import ConfigError, load, loopback
from producer.gateway.front.access import Inflight, Keyring
from producer.gateway.front.replies import field_of, problems
from producer.wire.keys import HIGH, NORMAL

TOKEN = "a-token-of-enough-length-0001"
KEYS = [{"name": "acme", "token": TOKEN}, {"name": "globex", "token": TOKEN + "x", "namespace": "globex",
                                           "lanes": ["normal"], "max_inflight": 3}]


def test_flags_win_over_variables_which_win_over_defaults():
    config = load({"port": 9000}, {"DQ_GATEWAY_PORT": "9100", "DQ_GATEWAY_MAX_BATCH": "50",
                                   "DQ_NAMESPACE": "prod", "DQ_REDIS_URL": "redis://r:6379/1"})
    assert (config.port, config.max_batch, config.deployment.namespace, config.deployment.url) == (
        9000, 50, "prod", "redis://r:6379/1")
    assert load({}, {}).host == "127.0.0.1" and load({}, {}).max_batch == 500


@pytest.mark.parametrize("values, environ, says", [
    ({"port": 0}, {}, "--port (DQ_GATEWAY_PORT) must be at least 1"),
    ({"max_batch": 501}, {}, "at most 500"),
    ({}, {"DQ_GATEWAY_WAIT_S": "soon"}, "DQ_GATEWAY_WAIT_S='soon' is not a number"),
    ({"wait_s": 400}, {}, "--wait-s (DQ_GATEWAY_WAIT_S) must be at most --max-wait-s"),
    ({"wait_s": float("nan")}, {}, "--wait-s (DQ_GATEWAY_WAIT_S) must be a finite number, got nan"),
    ({}, {"DQ_GATEWAY_MAX_WAIT_S": "inf"}, "--max-wait-s (DQ_GATEWAY_MAX_WAIT_S) must be a finite number"),
    ({"wait_s": float("inf"), "max_wait_s": float("inf")}, {}, "--wait-s (DQ_GATEWAY_WAIT_S) must be a finite"),
    ({}, {"DQ_GATEWAY_MAX_WAIT_S": "nan"}, "--max-wait-s (DQ_GATEWAY_MAX_WAIT_S) must be a finite number"),
    ({"log_level": "LOUD"}, {}, "DEBUG, INFO"),
    ({"host": "0.0.0.0"}, {}, "loopback"),
    ({}, {"DQ_NAMESPACE": "a{b}"}, "namespace"),
    ({}, {"DQ_REDIS_URL": "http://x"}, "redis://"),
    # An alias that is a served model's name (the model of a pair, known when parsed) would take its calls.
    ({"model_alias": ["decider-a=decider-a"]}, {}, "--model-alias (DQ_GATEWAY_MODEL_ALIAS): decider-a: an alias"),
    ({"model_alias": ["decider-b=decider-a", "decider-a=decider-c"]}, {}, "decider-a: an alias that names a served"),
])
def test_bad_settings_are_refused_naming_the_flag_and_variable(values, environ, says):
    with pytest.raises((ConfigError, ValueError), match=None) as refused:
        load(values, environ)
    assert says in str(refused.value)


def test_keys_come_from_a_file_or_a_variable_and_open_any_address(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    config = load({"api_keys_file": str(path), "host": "0.0.0.0"}, {})
    assert [k.name for k in config.keys] == ["acme", "globex"] and config.namespaces() == ["dq", "globex"]
    assert load({"host": "::"}, {"DQ_GATEWAY_API_KEYS": json.dumps(KEYS)}).keys == config.keys
    with pytest.raises(ConfigError, match="not both"):
        load({"api_keys_file": str(path)}, {"DQ_GATEWAY_API_KEYS": json.dumps(KEYS)})
    with pytest.raises(ConfigError, match="cannot be read"):
        load({"api_keys_file": str(tmp_path / "missing.json")}, {})


@pytest.mark.parametrize("keys", [
    [], {"name": "a"}, [{"name": "a", "token": "short"}], [{"name": "a b", "token": TOKEN}],
    [{"name": "a", "token": TOKEN + " x"}], [{"name": "a", "token": TOKEN, "lanes": []}],
    [{"name": "a", "token": TOKEN, "lanes": ["urgent"]}], [{"name": "a", "token": TOKEN, "namespace": "x:y"}],
    [{"name": "a", "token": TOKEN, "admin": True}],
    [{"name": "a", "token": TOKEN}, {"name": "a", "token": TOKEN + "2"}],
    [{"name": "a", "token": TOKEN}, {"name": "b", "token": TOKEN}], [{"name": "a", "token": TOKEN, "max_inflight": 0}],
])
def test_unusable_keys_are_refused_without_echoing_a_token(keys):
    with pytest.raises(ConfigError) as refused:
        load({}, {"DQ_GATEWAY_API_KEYS": json.dumps(keys)})
    tokens = [k["token"] for k in keys if "token" in k] if isinstance(keys, list) else []
    assert not any(token in str(refused.value) for token in tokens), refused.value


def test_a_token_finds_its_key_and_nothing_else_does():
    ring = Keyring(load({}, {"DQ_GATEWAY_API_KEYS": json.dumps(KEYS)}))
    acme, globex = ring.find(f"Bearer {TOKEN}"), ring.find(f"bearer {TOKEN}x")
    assert acme is not None and (acme.name, acme.namespace, acme.lanes, acme.max_inflight) == (
        "acme", "dq", frozenset({HIGH, NORMAL}), 256)
    assert globex is not None and (globex.namespace, globex.lanes, globex.max_inflight) == (
        "globex", frozenset({NORMAL}), 3)
    for header in (None, "", "Bearer", "Bearer ", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}",
                   f"Bearer {TOKEN}xx", f"Bearer {TOKEN.upper()}", "Bearer \udcff"):
        assert ring.find(header) is None, header
    opened = Keyring(load({}, {}))
    assert opened.open and opened.find(None).namespace == "dq"


def test_in_flight_limits_count_requests_per_key():
    ring = Keyring(load({}, {"DQ_GATEWAY_API_KEYS": json.dumps(KEYS)}))
    globex, acme, held = ring.find(f"Bearer {TOKEN}x"), ring.find(f"Bearer {TOKEN}"), Inflight()
    assert held.take(globex, 2) and not held.take(globex, 2) and held.take(acme, 200)
    held.give_back("globex", 2)
    assert held.take(globex, 3) and held.held == {"globex": 3, "acme": 200}


def test_loopback_and_the_field_of_a_problem():
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and loopback("127.1.2.3")
    assert not loopback("0.0.0.0") and not loopback("10.0.0.1") and not loopback("example.com")
    assert field_of(("body", "questions", "tone", "choice", "criteria")) == "questions.tone.criteria"
    assert field_of(("batch", "requests", 3, "one", "id")) == "requests.3.id"
    code, field, message = problems([{"type": "json_invalid", "loc": (), "msg": "Invalid JSON", "ctx": {
        "error": "EOF while parsing"}}])
    assert (code, field) == ("invalid_json", "body") and "EOF" in message


@pytest.mark.parametrize("argv", [["--wait-s", "nan"], ["--max-wait-s", "inf"], ["--wait-s", "inf", "--max-wait-s",
                                                                                  "inf"]])
def test_a_wait_that_is_not_a_finite_number_exits_2_before_listening(argv, capsys):
    from producer.gateway.__main__ import main

    assert main(argv) == 2
    assert "must be a finite number" in capsys.readouterr().err
