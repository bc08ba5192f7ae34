"""The one configuration mechanism: flags and variables derived from one declaration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import AliasChoices, Field, ValidationError

from lorafleet.app.main import main
from lorafleet.core.settings import ConfigError, ServiceSettings, add_flags, flag_fields, load
from lorafleet.scheduler.config import LocalStorage, SchedulerConfig
from lorafleet.scheduler.storage import S3Config


class Example(ServiceSettings):
    address: str = Field(
        "127.0.0.1:1", validation_alias=AliasChoices("EXAMPLE_ADDRESS"), description="where"
    )
    ttl_s: float = Field(60.0, gt=0, description="how long")
    tls: bool = Field(False, description="encrypt")
    path: Path | None = Field(None, description="a file")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    return parser.parse_args(argv)


def test_flags_override_the_environment_which_overrides_defaults() -> None:
    env = {"EXAMPLE_ADDRESS": "h:2", "LORAFLEET_TTL_S": "5", "LORAFLEET_TLS": "yes"}
    assert load(Example, parse(), env=env) == Example(address="h:2", ttl_s=5.0, tls=True)
    given = load(Example, parse("--ttl-s", "7", "--no-tls", "--path", "/x"), env=env)
    assert (given.ttl_s, given.tls, given.path) == (7.0, False, Path("/x"))
    assert load(Example, parse(), env={}) == Example()


def test_an_explicit_environment_ignores_the_process_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLEET_TTL_S", "9")
    assert load(Example, None).ttl_s == 9.0
    assert load(Example, None, env={}).ttl_s == 60.0


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--ttl-s", "0"], {}, "--ttl-s / LORAFLEET_TTL_S"),
        ([], {"LORAFLEET_TTL_S": "soon"}, "--ttl-s / LORAFLEET_TTL_S"),
        ([], {"LORAFLEET_TLS": "perhaps"}, "--tls / LORAFLEET_TLS"),
    ],
)
def test_bad_values_are_refused_naming_the_flag_and_the_variable(
    argv: list[str], env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        load(Example, parse(*argv), env=env)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_refused_as_such(value: str) -> None:
    # nan passes no bound check and would fail every one with a misleading message.
    with pytest.raises(ConfigError, match=r"--ttl-s / LORAFLEET_TTL_S: .*finite number"):
        load(Example, parse(), env={"LORAFLEET_TTL_S": value})


def test_settings_are_frozen() -> None:
    settings = load(Example, None, env={})
    with pytest.raises(ValidationError):
        settings.ttl_s = 1.0  # type: ignore[misc]


def test_every_scheduler_option_is_a_flag_with_help_and_its_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["scheduler", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, info in flag_fields(SchedulerConfig).items():
        assert f"--{name.replace('_', '-')}" in text
        assert info.description and info.description.split()[0] in text
    assert "[DATABASE_URL, LORAFLEET_DATABASE_URL" in text
    assert "[LORAFLEET_LEASE_TTL_S; default 60.0]" in text


def test_the_scheduler_refuses_a_bad_option_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["scheduler", "--data-dir", str(tmp_path), "--lease-ttl-s", "-1"])
    assert code != 0
    assert "--lease-ttl-s / LORAFLEET_LEASE_TTL_S: Input should be greater than 0" in (
        capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir()), "nothing is started before the options are valid"


def test_scheduler_storage_is_derived_from_the_flat_options() -> None:
    local = load(SchedulerConfig, None, env={"LORAFLEET_STORAGE_PORT": "8081"})
    assert local.storage == LocalStorage(host="127.0.0.1", port=8081, public_base_url=None)
    s3 = load(
        SchedulerConfig,
        None,
        env={"LORAFLEET_S3_BUCKET": "b", "LORAFLEET_S3_ENDPOINT_URL": "http://127.0.0.1:9"},
    )
    assert isinstance(s3.storage, S3Config)
    assert (s3.storage.bucket, s3.storage.addressing_style) == ("b", "path")
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        load(SchedulerConfig, None, env={"LORAFLEET_TLS_CERT": "/c.pem"})
