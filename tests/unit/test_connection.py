"""Where a producer connects: arguments, then the worker's DQ_* variables, then the defaults; URLs in messages."""

import pytest

from producer.plumbing.connection import Deployment, redact


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
    ({"DQ_REDIS_TLS_CA": "ca.pem"}, {}, "need a rediss:// or rediss\\+sentinel:// URL"),
    ({}, {"url": "http://h"}, "a Redis URL starts with redis://, rediss://, unix://, redis\\+sentinel://, "
                              "rediss\\+sentinel://, got http://h"),
    ({"DQ_WAIT_REPLICAS": "one"}, {}, "DQ_WAIT_REPLICAS='one' is not an integer"),
    ({}, {"wait_replicas": -1}, "wait_replicas .DQ_WAIT_REPLICAS. must be 0 to 16, got -1"),
    ({"DQ_SENTINEL_PASSWORD": "s3cret"}, {}, "the sentinels' credentials .* need a redis\\+sentinel://"),
    ({}, {"url": "redis+sentinel://h:1/dq", "cluster": True}, "not a Redis Cluster"),
    ({}, {"url": "127.0.0.1:6379"}, "a Redis URL starts with"),
])
def test_bad_values_are_named(environ, given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Deployment.resolve(environ, **given)


def test_a_sentinel_url_is_parsed_once_and_checked():
    from producer.plumbing import sentinel

    parsed = sentinel.parse("redis+sentinel://worker:p%40ss@s1:26379,s2,[::1]:26380/mymaster/3")
    assert parsed == sentinel.SentinelUrl((("s1", 26379), ("s2", 26379), ("::1", 26380)), "mymaster", 3, "worker",
                                          "p@ss", False)
    assert sentinel.parse("rediss+sentinel://:secret@s1:1/dq") == sentinel.SentinelUrl((("s1", 1),), "dq", 0,
                                                                                        None, "secret", True)
    deployment = Deployment.resolve({"DQ_WAIT_REPLICAS": "1"}, url="redis+sentinel://s1:26379/dq/0")
    assert (deployment.wait_replicas, deployment.url) == (1, "redis+sentinel://s1:26379/dq/0")
    assert Deployment.resolve({}, url="rediss+sentinel://s1/dq", tls_ca="ca.pem").tls_files() == {
        "ssl_ca_certs": "ca.pem"}
    # Durable mode on Redis Cluster is a WAIT per primary (producer/plumbing/cluster_wait.py): no longer refused.
    assert Deployment.resolve({"DQ_WAIT_REPLICAS": "1"}, url="redis://n1:7000/0", cluster=True).wait_replicas == 1


def test_the_sentinels_credentials_go_to_the_sentinels_alone_and_are_never_shown():
    from producer.plumbing import sentinel

    deployment = Deployment.resolve({"DQ_SENTINEL_USERNAME": "watch", "DQ_SENTINEL_PASSWORD": "s3cret"},
                                    url="rediss+sentinel://worker:pw@s1/dq", tls_ca="ca.pem")
    assert deployment.options() == {"ssl_ca_certs": "ca.pem", "sentinel_username": "watch",
                                    "sentinel_password": "s3cret"}
    assert "s3cret" not in repr(deployment)
    data, asked = sentinel._split({**deployment.options(), "socket_timeout": 1.0})
    assert data == {"ssl_ca_certs": "ca.pem", "socket_timeout": 1.0}  # the data nodes' password is the URL's
    assert asked == {"ssl_ca_certs": "ca.pem", "socket_timeout": 1.0, "username": "watch", "password": "s3cret"}


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://s1:26379", "names its service"),
    ("redis+sentinel://s1:26379/", "names its service"),
    ("redis+sentinel://s1:26379/my{master}", "names its service"),
    ("redis+sentinel://s1:26379/dq/zero", "only a database number"),
    ("redis+sentinel://s1:26379/dq/0/1", "only a database number"),
    ("redis+sentinel://u:pw@/dq", "each sentinel is host:port"),
    ("redis+sentinel://s1,,s2/dq", "each sentinel is host:port"),
    ("redis+sentinel://s1:99999/dq", "port is 1 to 65535"),
    ("redis+sentinel://u:se?cret@s1/dq", "no query"),
    # a port below 1 was taken for part of a host name, twenty digits for a database (issue: hostile callers)
    ("redis+sentinel://u:pw@s1:-1/dq", "port is 1 to 65535"),
    ("redis+sentinel://s1:+26379/dq", "port is 1 to 65535"),
    ("redis+sentinel://s1:0/dq", "port is 1 to 65535"),
    ("redis+sentinel://[::1]x/dq", "in brackets"),
    ("redis+sentinel://s1:26379/dq/123456789012345678901", "only a database number"),
    ("redis+sentinel://s1:26379/dq/2147483648", "0 to 2147483647"),
    ("redis://u:pw@h:6379/123456789012345678901", "database number is not 0 to 2147483647"),
    ("redis://u:pw@h:6379/0?db=-1", "database number is not 0 to 2147483647"),
])
def test_a_malformed_sentinel_url_is_named_without_its_password(url, message):
    with pytest.raises(ValueError, match=message) as caught:
        Deployment.resolve({}, url=url)
    assert "cret" not in str(caught.value) and "pw" not in str(caught.value)


def test_passwords_never_shown():
    assert redact("redis+sentinel://worker:s3cret@s1:26379,s2:26379/dq/0") == \
        "redis+sentinel://worker:***@s1:26379,s2:26379/dq/0"
    assert redact("rediss+sentinel://:s3cret@s1/dq") == "rediss+sentinel://:***@s1/dq"
    assert redact("redis://worker:s3cret@redis:6379/0") == "redis://worker:***@redis:6379/0"
    assert redact("rediss://:s3cret@redis/0") == "rediss://:***@redis/0"
    assert redact("redis://redis:6379/0") == "redis://redis:6379/0"
    assert "s3cret" not in Deployment(url="redis://u:s3cret@h/0").safe_url
    # redis-py takes its options from the query, the password too (issue: hostile callers)
    assert redact("redis://redis:6379/0?password=s3cret&db=1") == "redis://redis:6379/0?password=***&db=1"
    assert redact("unix:///run/redis.sock?db=0&Password=s3cret") == "unix:///run/redis.sock?db=0&Password=***"
    assert redact("rediss://u:s3cret@h/0?ssl_password=s3cret2") == "rediss://u:***@h/0?ssl_password=***"
    # a Sentinel URL takes no query (it is refused), but a password in one is hidden all the same
    assert redact("redis+sentinel://u:s3cret@s1/dq?password=s3cret2") == "redis+sentinel://u:***@s1/dq?password=***"
    assert "s3cret" not in Deployment(url="redis://h/0?password=s3cret").safe_url


def test_the_producer_speaks_the_workers_connection_vocabulary():
    from dataclasses import fields

    from worker.config import Settings

    worker_variables = {Settings.env_name(field.name) for field in fields(Settings)}
    assert set(Deployment.ENV.values()) - worker_variables == {"DQ_SHARDS"}  # producers spread, a worker reads one
    assert "DQ_WAIT_REPLICAS" in worker_variables
    worker_flags = {"--" + field.name.replace("_", "-") for field in fields(Settings)}
    assert {flags[0] for flags, _, _ in Deployment.FLAGS.values()} - worker_flags == {"--shards"}
