"""Served model names: what a worker serves under (--served-model-name, else the checkpoint's own name), what its
heartbeat says, and how a namespace's heartbeats become its catalog of models (producer/client/served.py)."""

from __future__ import annotations

import json
import time

import pytest

from producer.client.served import catalog
from producer.wire.keys import beat_models
from worker.__main__ import parser
from worker.config import Settings, SettingsError
from worker.model.checkpoint import own_name


def test_a_checkpoint_is_served_under_its_own_name_not_its_folders(tmp_path):
    plain = tmp_path / "v3-final"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "jev"}))
    assert own_name(plain) == "v3-final"  # nothing recorded: the folder is all there is
    (plain / "config.json").write_text(json.dumps({"model_type": "jev", "_name_or_path": "acme/decider-2b"}))
    assert own_name(plain) == "acme/decider-2b"
    (plain / "config.json").write_text(json.dumps({"model_type": "jev", "_name_or_path": "/home/me/ckpt"}))
    assert own_name(plain) == "v3-final"  # a path it was loaded from is no name
    snapshot = tmp_path / "hub" / "models--acme--decider-0.8b" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "jev"}))
    assert own_name(snapshot) == "acme/decider-0.8b"  # a Hugging Face cache's folder is a commit hash


def test_served_model_name_repeats_and_is_checked():
    args = parser().parse_args(["serve", "--checkpoint", "/m", "--served-model-name", "decider-b",
                                "--served-model-name", "jev-latest"])
    settings = Settings.from_args(args, environ={})
    assert settings.served_names == ("decider-b", "jev-latest")
    assert Settings.from_env({"DQ_SERVED_MODEL_NAME": "a,b"}).served_names == ("a", "b")
    assert Settings.from_env({}).served_names == ()
    for bad in ("has space", "a,a", "{tag}", "-leading", "x" * 129):
        with pytest.raises(SettingsError, match="--served-model-name"):
            Settings(served_model_name=bad)


def beat(*names: str, age: float = 0.0, field: str = "models") -> str:
    value: object = list(names) if field == "models" else names[0]
    return json.dumps({"ts": time.time() - age, "inflight": 0, field: value, "engine": "reference"})


def test_heartbeats_become_a_catalog_of_served_models():
    assert beat_models(beat("decider-a", "jev-latest")) == ("decider-a", "jev-latest")
    assert beat_models(beat("older-worker", field="model")) == ("older-worker",)  # a worker before served names
    assert beat_models("not json") == () and beat_models(json.dumps({"models": ["bad name", 3]})) == ()
    leaving = json.dumps({**json.loads(beat("decider-d")), "state": "draining"})
    beats = {b"w1": beat("decider-a", "jev-latest"), b"w2": beat("decider-a"), b"w3": beat("decider-b", "decider-a"),
             b"gone": beat("decider-c", age=60), b"leaving": leaving}
    found = catalog(beats, "alpha", time.time())
    assert set(found) == {"decider-a", "jev-latest", "decider-b"}  # the gone and the draining serve nothing
    assert found["decider-a"].name == "decider-a" and found["decider-a"].workers == 2  # a first name wins an alias
    assert found["jev-latest"] is found["decider-a"] and found["decider-a"].namespace == "alpha"
    assert found["decider-b"].names == ("decider-b", "decider-a")


def test_the_gateway_knows_where_callers_may_name_models():
    from producer.gateway.__main__ import parser as gateway_parser
    from producer.gateway.front.access import Keyring
    from producer.gateway.config import ConfigError, load

    keys = json.dumps([{"name": "a", "token": "t" * 20, "namespace": "acme", "model_namespaces": ["dq", "dq-b"]},
                       {"name": "b", "token": "u" * 20, "namespace": "beta"}, {"name": "c", "token": "v" * 20}])
    args = vars(gateway_parser().parse_args(["--model-alias", "jev-latest=decider-a", "--model-alias", "old=decider-b",
                                        "--model-namespaces", "dq,dq-c"]))
    config = load(args, {"DQ_GATEWAY_API_KEYS": keys})
    assert config.aliases == {"jev-latest": "decider-a", "old": "decider-b"}
    keyring = Keyring(config)
    assert keyring.find("Bearer " + "t" * 20).model_namespaces == ("dq", "dq-b")
    assert keyring.find("Bearer " + "u" * 20).model_namespaces == ("beta",)  # its own namespace
    assert keyring.find("Bearer " + "v" * 20).model_namespaces == ("dq", "dq-c")  # names none: the gateway's
    assert set(config.namespaces()) == {"acme", "beta", "dq", "dq-b", "dq-c"}  # a client for each
    open_gateway = load({"model_namespaces": "dq,dq-b"}, {})
    assert Keyring(open_gateway).find(None).model_namespaces == ("dq", "dq-b")
    for bad in ({"model_alias": "jev-latest"}, {"model_alias": "a=b,a=c"}, {"model_namespaces": "dq,{x}"}):
        with pytest.raises(ConfigError):
            load(bad, {})
