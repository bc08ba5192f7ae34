"""One configuration mechanism for every service: pydantic-settings models, flags derived from them.

Each option is declared once, as a field of a `ServiceSettings` subclass: its type, its default,
its environment variable (`LORAFLEET_<NAME>` unless the field names others with
`validation_alias=AliasChoices(...)`), and its help (the field's `description`). From that one
declaration:

* `add_flags(parser, Model)` adds `--name` to an argparse parser (booleans get `--name` /
  `--no-name`), with the variable and the default in the help text;
* `load(Model, args, **overrides)` reads the environment, lays the flags the user gave on top,
  then the keyword overrides, validates, and returns a frozen value, or raises `ConfigError`
  naming each bad option as the user wrote it (flag or variable) with the reason.
"""

from __future__ import annotations

import argparse
import contextvars
import types
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from lorafleet.core.errors import LorafleetError

ENV_PREFIX = "LORAFLEET_"


S = TypeVar("S", bound="ServiceSettings")
_explicit_env = contextvars.ContextVar("lorafleet_explicit_env", default=False)


class ConfigError(LorafleetError):
    """A service was started with a bad option; the message names each one and why."""


class ServiceSettings(BaseSettings):
    """Base of every service's settings: `LORAFLEET_*` variables, frozen once built."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        validate_default=True,
        env_ignore_empty=True,
        # nan passes no bound check, and fails every one with a misleading message: refused
        # first, as not a number.
        allow_inf_nan=False,
    )
    # Fields that are not options a user sets (built from others, or for tests only).
    not_flags: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # With an explicit environment (`load(env=...)`) the values are read from it before
        # validation, and the process environment must not leak in.
        if _explicit_env.get():
            return (init_settings,)
        return (init_settings, env_settings)


def env_names(name: str, info: FieldInfo) -> list[str]:
    """The environment variables a field reads, first match wins."""
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    if isinstance(alias, str):
        return [alias]
    return [f"{ENV_PREFIX}{name.upper()}"]


def _scalar(annotation: Any) -> tuple[Any, bool]:
    """(the base type, whether None is allowed) for `X | None`; (annotation, False) otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_fields(model: type[ServiceSettings]) -> dict[str, FieldInfo]:
    """The fields that are flags: plain values (str, numbers, bool, Path, Literal)."""
    out = {}
    for name, info in model.model_fields.items():
        base, _ = _scalar(info.annotation)
        if name in model.not_flags:
            continue
        if base in (str, int, float, bool, Path) or get_origin(base) is Literal:
            out[name] = info
    return out


def add_flags(
    parser: argparse.ArgumentParser,
    model: type[ServiceSettings],
    *,
    only: Collection[str] | None = None,
) -> None:
    """One flag per option (or per option named in `only`); unset flags stay None so the
    environment and the defaults apply."""
    for name, info in flag_fields(model).items():
        if only is not None and name not in only:
            continue
        base, _ = _scalar(info.annotation)
        variables = ", ".join(env_names(name, info))
        default = "" if info.is_required() else f"; default {info.get_default()!r}"
        help_text = f"{info.description or ''} [{variables}{default}]".strip()
        kwargs: dict[str, Any] = {"default": None, "help": help_text, "dest": name}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(base) is Literal:
            kwargs["choices"] = [str(c) for c in get_args(base)]
        else:
            kwargs["type"] = str if base is Path else base
            kwargs["metavar"] = name.upper()
        parser.add_argument(_flag_name(name), **kwargs)


def load(
    model: type[S],
    args: argparse.Namespace | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> S:
    """Environment, then the flags given in `args`, then `overrides` (None means unset)."""
    values: dict[str, Any] = {}
    if args is not None:
        for name in flag_fields(model):
            value = getattr(args, name, None)
            if value is not None:
                values[name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        if env is None:
            return model(**values)
        # An explicit environment (tests, a child's): read it alone, never os.environ.
        for name, info in model.model_fields.items():
            if name not in values:
                found = next(
                    (env[v] for v in env_names(name, info) if env.get(v, "").strip()), None
                )
                if found is not None:
                    values[name] = found.strip()
        token = _explicit_env.set(True)
        try:
            return model(**values)
        finally:
            _explicit_env.reset(token)
    except ValidationError as exc:
        raise ConfigError(describe(model, exc)) from None


def describe(model: type[ServiceSettings], exc: ValidationError) -> str:
    """`--lease-ttl-s / LORAFLEET_LEASE_TTL_S: Input should be greater than 0` per error."""
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        info = model.model_fields.get(name)
        if info is None:
            where = name or "configuration"
        else:
            where = " / ".join([_flag_name(name), *env_names(name, info)])
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)
