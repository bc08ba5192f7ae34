"""The job spec from the command line: a flag per JobSpec field, and the file they override.

Every JobSpec field is a flag (`--learning-rate 2e-4`, `--train-text-encoder`,
`--label team=a`), built from its declaration in core/spec.py (type, choices, help, default) so
that no option can be forgotten; a YAML or JSON file (`--spec job.yaml`) gives the same fields,
and flags override it.

Apart from the commands because it maps core/spec.py's declarations to argparse and back, a
concern of its own: the commands only add its flags and read back the spec they give.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.spec import SPEC_FIELD, SPEC_FIELDS, SpecField, spec_value


def _spec_help(f: SpecField) -> str:
    """A flag's help: the field's declared help and its default."""
    shown = f.shown_default
    text = f.help if shown is None else f"{f.help} (default: {shown})"
    return text.replace("%", "%%")


def _int_or(zero: str) -> Callable[[str], int]:
    """An int flag's parser; `zero` (e.g. "auto") stands for 0."""

    def parse(text: str) -> int:
        return 0 if zero and text == zero else int(text)

    parse.__name__ = "int"  # argparse names the type in its error: "invalid int value"
    return parse


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per JobSpec field, from its declaration in core/spec.py: type, choices, help."""
    group = parser.add_argument_group("job spec (any field of lorafleet.jobs.v1.JobSpec)")
    for f in SPEC_FIELDS:
        if f.name in ("labels", "webhook_url", "webhook_events"):
            continue  # their own flags, after the loop
        flag, dest, help_text = f.flag, f"spec_{f.name}", _spec_help(f)
        if f.kind == "choice":
            # In any case, as a spec file's or the SDK's value (`FLUX` is flux): the choices
            # are lower case.
            group.add_argument(flag, dest=dest, type=str.lower, choices=f.choices, help=help_text)
        elif f.kind == "texts":
            # e.g. --validation-prompts "..." --validation-prompts "...": once per value.
            group.add_argument(flag, dest=dest, action="append", metavar="TEXT", help=help_text)
        elif f.kind == "bool":
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif f.kind == "int":
            metavar = f"N|{f.zero}" if f.zero else "N"
            group.add_argument(
                flag, dest=dest, type=_int_or(f.zero), metavar=metavar, help=help_text
            )
        elif f.kind == "float":
            group.add_argument(flag, dest=dest, type=float, metavar="X", help=help_text)
        else:
            group.add_argument(flag, dest=dest, metavar="TEXT", help=help_text)
    labels, url, events = (SPEC_FIELD[n] for n in ("labels", "webhook_url", "webhook_events"))
    group.add_argument(
        labels.flag, action="append", default=[], metavar="KEY=VALUE", help=_spec_help(labels)
    )
    group.add_argument(url.flag, help=_spec_help(url))
    group.add_argument(
        events.flag,
        action="append",
        default=[],
        type=str.lower,
        choices=events.choices,
        help=_spec_help(events),
    )


def parse_labels(pairs: list[str], field: str = "label") -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidArgument(field, f"expected KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: PyYAML follows YAML 1.1, where `1e-3` (no
    dot) is a string, so `learning_rate: 1e-3`, the README's own value, was refused as "expected
    a number". A subclass, so that no other YAML this process reads changes."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    # YAML 1.2's core schema: 1e-3, 1E5, .5, 2.0, -1.5e+3, and .inf/.nan as before.
    re.compile(
        r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_document(path: Path, field: str) -> Any:
    """The document in a --spec or --batch file (`field` names the flag): JSON for a .json
    file, else YAML. A file that cannot be read or parsed is one line naming it and where it
    is malformed, as any other bad input, not the parser's traceback."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidArgument(field, f"cannot read {path}: {reason}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(
                field,
                f"{path} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
            ) from None
    try:
        return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InvalidArgument(field, f"{path} is not valid YAML{_yaml_where(exc)}") from None


def _yaml_where(exc: yaml.YAMLError) -> str:
    """Where the YAML parser stopped and why, on one line (its own message spans several)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f": {' '.join(str(exc).split())}"
    mark = exc.problem_mark
    return f" at line {mark.line + 1}, column {mark.column + 1}: {exc.problem or 'malformed'}"


def load_spec_file(path: Path) -> dict[str, Any]:
    """A --spec file's fields: its top level must be a mapping of them."""
    document = load_document(path, "spec")
    if not isinstance(document, dict):
        found = "nothing" if document is None else f"a {type(document).__name__}"
        raise InvalidArgument(
            "spec", f"{path} must hold a mapping of spec fields (field: value); it holds {found}"
        )
    return document


def _dest(f: SpecField) -> str:
    """Where argparse keeps a field's flag: `spec_<name>`, but for the fields with flags of
    their own (`--label` is `label`)."""
    if f.name in ("labels", "webhook_url", "webhook_events"):
        return f.flag.removeprefix("--").replace("-", "_")
    return f"spec_{f.name}"


def given_spec_flags(args: argparse.Namespace) -> list[str]:
    """The spec flags given on the command line (`--max-train-steps`), in the fields' order."""
    return [f.flag for f in SPEC_FIELDS if getattr(args, _dest(f)) not in (None, [])]


def spec_from_args(args: argparse.Namespace, base: Mapping[str, Any] | None) -> dict[str, Any]:
    spec = dict(base or {})
    for key, value in vars(args).items():
        if key.startswith("spec_") and value is not None:
            spec[key.removeprefix("spec_")] = value
    if args.label:
        spec["labels"] = {**spec.get("labels", {}), **parse_labels(args.label)}
    if args.webhook_url or args.webhook_event:
        # The flags replace a file's webhook, whichever way the file says it.
        spec.pop("webhook_url", None)
        spec.pop("webhook_events", None)
        spec["webhook"] = {"url": args.webhook_url or "", "events": args.webhook_event}
    return spec


def named_family(spec: Mapping[str, Any], *, where: str = "") -> str:
    """The spec's model_family as the server reads it (`spec_value`: in any case, so `FLUX` is
    flux); a value the server refuses is refused here, naming the field."""
    value = spec.get("model_family")
    if value is None:
        return "auto"
    try:
        return str(spec_value("model_family", value))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}{exc.field}", exc.reason) from None
