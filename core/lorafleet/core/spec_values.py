"""The conversion of a job spec's values to their fields' types: the one conversion every spec's
values take, whether a YAML or JSON file, the SDK's keywords or a stored spec give them. JobSpec
runs it on each value as it is made; `spec.spec_value` runs it on a value named by its field.

- `typed_value`: a value in its declared field's type (core/spec.py's `SpecField.kind`). Choice
  names in any case ("FLUX" is flux); an int field's zero word ("auto") is 0; an int is a
  number. Anything else of another type is refused, naming the field and the type it expected:
  no bool for a number nor a number for a bool, no number read from text ("512" is refused, as
  the proto's typed fields refuse it);
- `_shown`: a refused value as a YAML or JSON file says it.

The values' bounds are the checks' (core/spec_checks.py, `check_spec`). This module needs only
the declaration's types, so core/spec.py imports it and it imports core/spec.py for types alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lorafleet.core.errors import InvalidArgument

if TYPE_CHECKING:
    from lorafleet.core.spec import FieldKind, SpecField

_EXPECTED: dict[FieldKind, str] = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "text": "text",
    "texts": "a list of text",
    "choices": "a list of names",
    "map": "a mapping of text to text",
}


def typed_value(declared: SpecField, value: Any) -> Any:
    """The value in its declared field's type, or InvalidArgument naming the field and the type
    it expected."""
    kind = declared.kind
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and declared.zero and value == declared.zero:
        return 0
    # bool is an int in Python: `guidance_scale: true` would otherwise train with 1.0.
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "text" and isinstance(value, str):
        return value
    if kind == "choice" and isinstance(value, str):
        return _choice(declared, declared.name, value)
    if kind in ("texts", "choices") and isinstance(value, (list, tuple)):
        items = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise InvalidArgument(f"{declared.name}[{i}]", f"expected text, got {_shown(item)}")
            items.append(
                _choice(declared, f"{declared.name}[{i}]", item) if declared.choices else item
            )
        return tuple(items)
    if kind == "map" and isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, str):
                bad = item if isinstance(key, str) else key
                raise InvalidArgument(
                    f"{declared.name}[{key!r}]", f"expected text, got {_shown(bad)}"
                )
        return dict(value)
    expected = f"one of {', '.join(declared.choices)}" if kind == "choice" else _EXPECTED[kind]
    if kind == "int" and declared.zero:
        expected += f" or {declared.zero}"
    raise InvalidArgument(declared.name, f"expected {expected}, got {_shown(value)}")


def _choice(declared: SpecField, name: str, value: str) -> str:
    # Choice names in any case, as the proto's enum names are upper case: FLUX is flux.
    if value.lower() not in declared.choices:
        plural = "s" if declared.kind == "choices" else ""
        what = declared.name.replace("_", " ").removesuffix(plural)
        raise InvalidArgument(name, f"unknown {what} {value!r} (use {', '.join(declared.choices)})")
    return value.lower()


def _shown(value: Any) -> str:
    """A value of the wrong type as a YAML or JSON file says it: true, null, '512', a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"
