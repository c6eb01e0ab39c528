import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from worker.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_environment_then_flags():
    env = {"DQ_CLAIM_IDLE_MS": "1234", "DQ_FP8": "yes", "DQ_REDIS_URL": "rediss://r:6380/1"}
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(["--claim-idle-ms", "99", "--no-cuda-graphs"]), env)
    assert settings.claim_idle_ms == 99  # the flag wins
    assert settings.fp8 is True and settings.redis_url == "rediss://r:6380/1"  # the environment fills in
    assert settings.cuda_graphs is False
    assert settings.max_deliveries == Settings().max_deliveries  # defaults for the rest


def test_bad_environment_values_are_named():
    with pytest.raises(ValueError, match="DQ_FP8='maybe' is not a boolean"):
        Settings.from_env({"DQ_FP8": "maybe"})
    with pytest.raises(ValueError, match="DQ_READ_COUNT='lots' is not a valid int"):
        Settings.from_env({"DQ_READ_COUNT": "lots"})


def test_buckets_and_consumer_name():
    settings = Settings(buckets="8192, 2048,4096")
    assert settings.bucket_sizes == (2048, 4096, 8192)
    assert Settings().consumer_name and Settings(consumer="gpu-7").consumer_name == "gpu-7"


@pytest.mark.parametrize("field", [f.name for f in fields(Settings)])
def test_readme_documents_every_setting_with_its_default(field):
    default = next(f.default for f in fields(Settings) if f.name == field)
    row = next((line for line in README.splitlines() if line.startswith(f"| `--{field.replace('_', '-')}` ")), None)
    assert row is not None, f"README has no row for --{field}"
    assert f"`{Settings.env_name(field)}`" in row and f"`{default!r}`" in row
