"""Where a producer connects: arguments, then the worker's DQ_* variables, then the defaults; URLs in messages."""

import pytest

from producer.connection import Deployment, redact


def test_arguments_then_environment_then_defaults():
    assert Deployment.resolve({}) == Deployment()
    environ = {"DQ_REDIS_URL": "rediss://h:6380/1", "DQ_NAMESPACE": "prod", "DQ_REDIS_CLUSTER": "yes",
               "DQ_SHARDS": "4", "DQ_REDIS_TLS_CA": "ca.pem"}
    assert Deployment.resolve(environ) == Deployment("rediss://h:6380/1", "prod", True, 4, tls_ca="ca.pem")
    given = Deployment.resolve(environ, url="rediss://other/0", shards=2, cluster=False, namespace=None)
    assert (given.url, given.shards, given.cluster, given.namespace) == ("rediss://other/0", 2, False, "prod")
    assert given.tls_files() == {"ssl_ca_certs": "ca.pem"}


@pytest.mark.parametrize("environ, given, message", [
    ({"DQ_SHARDS": "two"}, {}, "DQ_SHARDS='two' is not an integer"),
    ({"DQ_REDIS_CLUSTER": "maybe"}, {}, "DQ_REDIS_CLUSTER='maybe' is not a boolean"),
    ({}, {"shards": 0}, "shards must be at least 1"),
    ({"DQ_REDIS_TLS_CA": "ca.pem"}, {}, "need a rediss:// URL"),
    ({}, {"url": "http://h"}, "a Redis URL starts with redis://, rediss:// or unix://, got http://h"),
    ({}, {"url": "127.0.0.1:6379"}, "a Redis URL starts with"),
])
def test_bad_values_are_named(environ, given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Deployment.resolve(environ, **given)


def test_passwords_never_shown():
    assert redact("redis://worker:s3cret@redis:6379/0") == "redis://worker:***@redis:6379/0"
    assert redact("rediss://:s3cret@redis/0") == "rediss://:***@redis/0"
    assert redact("redis://redis:6379/0") == "redis://redis:6379/0"
    assert "s3cret" not in Deployment(url="redis://u:s3cret@h/0").safe_url


def test_the_producer_speaks_the_workers_connection_vocabulary():
    from dataclasses import fields

    from producer.__main__ import CONNECTION
    from worker.config import Settings

    worker_variables = {Settings.env_name(field.name) for field in fields(Settings)}
    assert set(Deployment.ENV.values()) - worker_variables == {"DQ_SHARDS"}  # producers spread, a worker reads one
    worker_flags = {"--" + field.name.replace("_", "-") for field in fields(Settings)}
    assert {flags[0] for flags, _, _ in CONNECTION.values()} - worker_flags == {"--shards"}
