"""The scaler's settings: one declaration per option, flags and variables from it, checked."""

from __future__ import annotations

import argparse

import pytest

from lorafleet.core.settings import ConfigError, add_flags, load
from lorafleet.scaler.config import ScalerSettings
from lorafleet.scaler.policy import PolicyConfig

SALAD_ENV = {
    "LORAFLEET_PROVIDER": "salad",
    "LORAFLEET_SALAD_ORGANIZATION": "acme",
    "LORAFLEET_SALAD_PROJECT": "fleet",
    "LORAFLEET_SALAD_GROUP": "workers",
    "SALAD_API_KEY": "k-123",
}


def test_defaults_are_the_local_provider_and_a_valid_policy() -> None:
    settings = load(ScalerSettings, env={})
    assert settings.provider == "local" and not settings.dry_run
    assert settings.policy_config() == PolicyConfig()


def test_salad_from_the_environment_with_the_usual_key_variable() -> None:
    settings = load(ScalerSettings, env=SALAD_ENV)
    config = settings.salad_config()
    assert (config.organization, config.project, config.group) == ("acme", "fleet", "workers")
    assert config.api_key == "k-123"
    assert "k-123" not in repr(settings) and "k-123" not in repr(config)


def test_flags_cover_every_option_but_the_key() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ScalerSettings)
    text = parser.format_help()
    for flag in ("--provider", "--max-replicas", "--idle-grace-s", "--dry-run", "--ec2-fleet"):
        assert flag in text
    assert "--salad-api-key" not in text
    args = parser.parse_args(["--max-replicas", "40", "--dry-run", "--reallocate-share", "0.2"])
    settings = load(ScalerSettings, args, env=SALAD_ENV)
    assert settings.max_replicas == 40 and settings.dry_run
    assert settings.policy_config().reallocate_share == 0.2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LORAFLEET_PROVIDER": "salad"}, "needs --salad-organization"),
        ({**SALAD_ENV, "SALAD_API_KEY": ""}, "SALAD_API_KEY"),
        ({**SALAD_ENV, "LORAFLEET_MAX_REPLICAS": "600"}, "at most 500"),
        ({**SALAD_ENV, "LORAFLEET_SALAD_GROUP": "Bad_Name"}, "--salad-group"),
        ({"LORAFLEET_PROVIDER": "ec2", "LORAFLEET_EC2_REGION": "us-east-1"}, "launch-template"),
        ({"LORAFLEET_EC2_LAUNCH_TEMPLATE_ID": "template"}, "--ec2-launch-template-id"),
        ({"LORAFLEET_MIN_REPLICAS": "5", "LORAFLEET_MAX_REPLICAS": "2"}, "min_replicas"),
        ({"LORAFLEET_REALLOCATE_SHARE": "1.5"}, "--reallocate-share"),
        ({"LORAFLEET_TICK_INTERVAL_S": "0"}, "--tick-interval-s"),
        ({"LORAFLEET_PROVIDER": "gcp"}, "--provider"),
    ],
)
def test_bad_options_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(ScalerSettings, env=env)


def test_ec2_config() -> None:
    settings = load(
        ScalerSettings,
        env={
            "LORAFLEET_PROVIDER": "ec2",
            "LORAFLEET_EC2_REGION": "eu-west-1",
            "LORAFLEET_EC2_LAUNCH_TEMPLATE_ID": "lt-0abc",
            "LORAFLEET_EC2_FLEET": "prod",
        },
    )
    config = settings.ec2_config()
    assert (config.region, config.launch_template_id, config.fleet) == (
        "eu-west-1",
        "lt-0abc",
        "prod",
    )
    assert config.launch_template_version == "$Latest"


def test_slow_min_peers_also_reads_its_old_variable_name() -> None:
    # Renamed when a timing measurement became an "observation": old deployments keep working.
    assert load(ScalerSettings, env={"LORAFLEET_SLOW_MIN_SAMPLES": "5"}).slow_min_peers == 5
    assert load(ScalerSettings, env={"LORAFLEET_SLOW_MIN_PEERS": "4"}).slow_min_peers == 4
    parser = argparse.ArgumentParser()
    add_flags(parser, ScalerSettings)
    settings = load(ScalerSettings, parser.parse_args(["--slow-min-peers", "6"]), env={})
    assert settings.policy_config().slow_min_peers == 6
