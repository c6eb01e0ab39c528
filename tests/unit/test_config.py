import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from producer.local.ports import free_port
from worker.config import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]


def test_environment_then_flags():
    env = {"DQ_CLAIM_IDLE_MS": "1234", "DQ_FP8": "yes", "DQ_REDIS_URL": "rediss://r:6380/1"}
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(["--claim-idle-ms", "99", "--no-cuda-graphs"]), env)
    assert settings.claim_idle_ms == 99  # the flag wins
    assert settings.fp8 is True and settings.redis_url == "rediss://r:6380/1"  # the environment fills in
    assert settings.cuda_graphs is False
    assert settings.max_deliveries == Settings().max_deliveries  # defaults for the rest


def test_deterministic_mode_is_unset_until_the_worker_decides_unless_a_flag_or_the_environment_says():
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    parse = lambda argv, env: Settings.from_args(parser.parse_args(argv), env).deterministic  # noqa: E731
    assert Settings().deterministic is None and parse([], {}) is None
    assert parse(["--deterministic"], {}) is True and parse(["--no-deterministic"], {}) is False
    assert parse([], {"DQ_DETERMINISTIC": "off"}) is False and parse([], {"DQ_DETERMINISTIC": "auto"}) is None
    assert parse(["--deterministic"], {"DQ_DETERMINISTIC": "0"}) is True  # the flag wins
    with pytest.raises(ValueError, match=r"DQ_DETERMINISTIC='sometimes' is not a boolean \(or auto\)"):
        Settings.from_env({"DQ_DETERMINISTIC": "sometimes"})


def test_bad_environment_values_are_named():
    with pytest.raises(ValueError, match="DQ_FP8='maybe' is not a boolean"):
        Settings.from_env({"DQ_FP8": "maybe"})
    with pytest.raises(ValueError, match="DQ_READ_COUNT='lots' is not a valid int"):
        Settings.from_env({"DQ_READ_COUNT": "lots"})


def test_buckets_and_consumer_name():
    settings = Settings(buckets="8192, 2048,4096")
    assert settings.listed_buckets == (2048, 4096, 8192)
    assert Settings().consumer_name and Settings(consumer="gpu-7").consumer_name == "gpu-7"


@pytest.mark.parametrize("pack_tokens, buckets, graphed", [
    (16384, "2048,4096,8192,16384", (2048, 4096, 8192, 16384)),  # the defaults: nothing to decide
    (4096, "2048,4096,8192,16384", (2048, 4096)),  # lowered for latency: the larger buckets would hold no pack
    (6000, "2048,4096,8192,16384", (2048, 4096, 6000)),  # between two: the budget is a bucket of its own
    (32768, "2048,4096,8192,16384", (2048, 4096, 8192, 16384, 32768)),  # raised: packs that large are graphed too
    (16384, "2048,4096", (2048, 4096, 16384)),  # --buckets lowered alone no longer lowers the budget in silence
])
def test_pack_tokens_is_every_packs_budget_and_the_largest_bucket(pack_tokens, buckets, graphed):
    """--pack-tokens decides the budget, with CUDA graphs or without: it was once ignored under graphs (the budget
    was the largest bucket, both 16384 by default), so an operator lowering it for latency got nothing."""
    settings = Settings(pack_tokens=pack_tokens, buckets=buckets)
    assert settings.bucket_sizes == graphed and max(settings.bucket_sizes) == pack_tokens


@pytest.mark.parametrize("environ, named", [
    ({"DQ_SHARD": "-3"}, "--shard (DQ_SHARD) must be at least 0, got -3"),
    ({"DQ_PACK_TOKENS": "0"}, "--pack-tokens (DQ_PACK_TOKENS) must be at least 1, got 0"),
    ({"DQ_LOG_FORMAT": "yaml"}, "--log-format (DQ_LOG_FORMAT) must be one of text, json, got 'yaml'"),
    ({"DQ_LOG_LEVEL": "verbose"}, "--log-level (DQ_LOG_LEVEL) must be one of DEBUG, INFO, WARNING, ERROR"),
    ({"DQ_ENGINE": "fsat"}, "--engine (DQ_ENGINE) must be one of auto, fast, reference, got 'fsat'"),
    ({"DQ_DEVICE": "gpu"}, "--device (DQ_DEVICE) must be auto, cpu, cuda or cuda:N"),
    ({"DQ_BLOCK_MS": "5000"}, "--block-ms (DQ_BLOCK_MS) must be at most 4000"),
    ({"DQ_METRICS_PORT": "70000"}, "--metrics-port (DQ_METRICS_PORT) must be at most 65535"),
    ({"DQ_NAMESPACE": "a{b}"}, "--namespace (DQ_NAMESPACE) must be 1 to 64 of"),
    ({"DQ_BUCKETS": "2048,x"}, "--buckets (DQ_BUCKETS) must be comma-separated token counts"),
    ({"DQ_CLAIM_IDLE_MS": "0"}, "--claim-idle-ms (DQ_CLAIM_IDLE_MS) must be at least 1"),
    ({"DQ_REDIS_URL": "http://user:secret@host"}, "--redis-url (DQ_REDIS_URL) must be a redis://"),
    ({"DQ_REDIS_URL": "redis://worker:se/cret@host:6379/0"}, "--redis-url (DQ_REDIS_URL) must be a usable Redis URL: "
                                                             "it cannot be parsed (percent-encode"),
    ({"DQ_REDIS_URL": "redis://worker:se?cret@host:6379/0"}, "it cannot be parsed"),
    ({"DQ_REDIS_URL": "redis://worker:secret@host:6379/zero"}, "its path is not a database number"),
    ({"DQ_RESULT_TTL_S": "0"}, "--result-ttl-s (DQ_RESULT_TTL_S) must be at least 1, got 0"),
    ({"DQ_RESULT_TTL_S": "-1"}, "--result-ttl-s (DQ_RESULT_TTL_S) must be at least 1, got -1"),
    ({"DQ_STALL_TIMEOUT_S": "0"}, "--stall-timeout-s (DQ_STALL_TIMEOUT_S) must be at least 1"),
    # A record says what its result says: never kept past it.
    ({"DQ_RESULT_TTL_S": "3600", "DQ_RECORD_TTL_S": "7200"}, "--record-ttl-s (DQ_RECORD_TTL_S) must be at most "
                                                             "--result-ttl-s (3600), got 7200"),
    ({"DQ_EPILOGUES": "swiglu,bogus"}, "--epilogues (DQ_EPILOGUES) must be none, all, or some of swiglu, residual, "
                                       "gated_norm comma-separated, got 'swiglu,bogus'"),
    ({"DQ_FP8_LAYERS": "3-"}, "--fp8-layers (DQ_FP8_LAYERS) must be all, full, linear, late or layer indices"),
    ({"DQ_FP8_MATRICES": "mlp,gates"}, "--fp8-matrices (DQ_FP8_MATRICES) must be all, or some of mlp, attention, "
                                       "linear comma-separated, got 'mlp,gates'"),
])
def test_out_of_range_and_unknown_values_are_refused_naming_flag_and_variable(environ, named):
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(environ)
    assert named in str(refused.value)
    assert "secret" not in str(refused.value)


def test_every_problem_is_named_at_once_and_choices_take_any_case():
    with pytest.raises(SettingsError, match="pack-tokens.*log-format"):
        Settings.from_env({"DQ_PACK_TOKENS": "0", "DQ_LOG_FORMAT": "yaml"})
    settings = Settings.from_env({"DQ_LOG_LEVEL": "debug", "DQ_ENGINE": "Reference"})
    assert settings.log_level == "DEBUG" and settings.engine == "reference"
    assert Settings().replace(shard=3).shard == 3
    with pytest.raises(SettingsError):
        Settings().replace(read_count=0)


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m worker ARGS`` in a child that reports whether torch was imported."""
    code = ("import sys; from worker.__main__ import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_serve_refuses_bad_settings_with_exit_2_before_loading_anything(tiny_dir):
    done = run_worker("serve", "--checkpoint", str(tiny_dir), "--engine", "fsat", "--log-level", "verbose",
                      "--epilogues", "bogus", "--fp8-layers", "nonsense", env={"DQ_SHARD": "-3"})
    assert done.returncode == 2, done.stderr
    assert "dq-worker serve: error: --engine (DQ_ENGINE) must be one of auto, fast, reference" in done.stderr
    assert "--log-level" in done.stderr and "--shard (DQ_SHARD)" in done.stderr
    assert "--epilogues (DQ_EPILOGUES)" in done.stderr and "--fp8-layers (DQ_FP8_LAYERS)" in done.stderr
    assert "Traceback" not in done.stderr and "no torch" in done.stdout  # refused before torch, let alone the model


def test_a_redis_url_with_an_unencoded_slash_in_its_password_is_refused_before_loading_and_never_shown(tiny_dir):
    """It once exited 70 after the model loaded, logging the password's first part at CRITICAL."""
    done = run_worker("serve", "--checkpoint", str(tiny_dir), env={"DQ_REDIS_URL": "redis://worker:hunter7/xyz@h:1/0"})
    assert done.returncode == 2 and "--redis-url (DQ_REDIS_URL) must be a usable Redis URL" in done.stderr
    assert "hunter7" not in done.stderr + done.stdout and "xyz" not in done.stderr + done.stdout
    assert "no torch" in done.stdout and "Traceback" not in done.stderr
    fine = Settings(redis_url="redis://worker:hunter7%2Fxyz@h:1/0")  # percent-encoded, it is accepted
    assert "hunter7" not in fine.redis_where


def test_check_asks_the_port_serve_serves_and_names_the_url():
    off = run_worker("check", env={"DQ_METRICS_PORT": "0"})
    assert off.returncode == 2 and "--metrics-port (DQ_METRICS_PORT) is 0" in off.stderr
    port = str(free_port())  # nothing listens there
    for args, env in ((["check"], {"DQ_METRICS_PORT": port}), (["check", "--metrics-port", port, "--live"], {})):
        done = run_worker(*args, env=env)
        path = "/healthz" if "--live" in args else "/readyz"
        assert done.returncode == 1 and f"http://127.0.0.1:{port}{path} unreachable" in done.stdout, done


def test_the_fast_engine_where_it_cannot_run_is_refused_with_exit_2_naming_the_reference_engine(tiny_dir):
    """On a CPU the fast engine cannot run: one line that says so and what to run instead, no traceback."""
    done = run_worker("serve", "--checkpoint", str(tiny_dir), "--engine", "fast", "--device", "cpu",
                      env={"DQ_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot start:" in done.stderr and "--engine reference" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_turns_the_fast_engines_refusals_into_exit_2_and_lets_other_errors_through():
    """The fast engine's refusals (it cannot run here; deterministic mode's check at warm-up failed) end serve with
    one line and exit 2; any other RuntimeError is a fault and keeps its traceback."""
    from worker.__main__ import _refused_here
    from worker.fast import FastPathUnavailable, deterministic

    assert _refused_here(FastPathUnavailable("no CUDA")) and _refused_here(deterministic.NotDeterministic("other bits"))
    assert not _refused_here(RuntimeError("CUDA error: an illegal memory access was encountered"))
