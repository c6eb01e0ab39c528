"""One vocabulary of flags: serve's help in sections with its choices shown, and the connection flags spelled the
same on serve, load-functions and dq-producer (serve --redis once matched five flags; load-functions had no TLS)."""

import argparse

from producer.cli.main import parser as producer_parser
from worker.__main__ import parser as worker_parser
from worker.config import SECTIONS


def subcommand(top: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    [commands] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_serve_help_is_in_sections_with_choices_shown():
    text = subcommand(worker_parser(), "serve").format_help()
    for title in SECTIONS.values():
        assert f"\n{title}:\n" in text, title
    assert "{text,json}" in text and "{DEBUG,INFO,WARNING,ERROR}" in text and "{auto,fast,reference}" in text
    assert text.startswith("usage: dq-worker serve --checkpoint DIR [--redis-url URL] [option ...]")


def test_connection_flags_are_spelled_the_same_everywhere():
    connection = flags(subcommand(producer_parser(), "stats")) - {"-h", "--help", "--json", "--watch"}  # its own
    serve = flags(subcommand(worker_parser(), "serve"))
    load = flags(subcommand(worker_parser(), "load-functions"))
    assert connection - {"--shards"} <= serve, connection - serve  # a worker reads one --shard
    assert connection <= load, connection - load  # --wait-replicas there: every primary's replicas confirm
    args = worker_parser().parse_args(["serve", "--redis", "redis://r:6379/0", "--cluster"])
    assert args.redis_url == "redis://r:6379/0" and args.redis_cluster is True
    args = worker_parser().parse_args(["load-functions", "--redis", "rediss://admin:x@r:6379/0",
                                       "--redis-tls-ca", "ca.pem", "--redis-tls-cert", "c.pem",
                                       "--redis-tls-key", "k.pem"])
    assert (args.url, args.tls_ca, args.tls_cert, args.tls_key) == ("rediss://admin:x@r:6379/0", "ca.pem", "c.pem",
                                                                     "k.pem")
