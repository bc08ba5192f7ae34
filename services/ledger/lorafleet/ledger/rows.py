"""From a query's row to a typed record, by the record's field names: one rule instead of a
hand-written `name=row["name"]` per field.

`record(Cls, row)` builds the frozen dataclass `Cls` from the row's columns of the same names,
converting each value to what the field's annotation says, in the only ways the driver's types
differ from the domain's:

* `uuid.UUID` to `str` for a `str` field (ids are strings above the ledger);
* a list (Postgres array) to a `tuple` for a tuple field;
* `bytes`-like (`memoryview`) to `bytes`, a jsonb mapping to a `dict`;
* an `int`, `Decimal` or `float` to `float` for a float field (numeric aggregates).

`None` passes through for an optional field, and is refused (`TypeError`) for one that is not:
a query that returns NULL where the record promises a value is a bug to find at once. A field
whose column has another name or needs more than a conversion is given by keyword
(`record(Cls, row, at=...)`); a column the row lacks for a field with a default takes the
default. So a record's fields and a query's columns are kept in step by their names, and a
misspelt or missing column fails loudly.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import asyncpg

T = TypeVar("T")

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    base: Any  # the annotation without its `| None`
    optional: bool
    has_default: bool


_FIELDS: dict[type, tuple[_Field, ...]] = {}


def _fields(cls: type) -> tuple[_Field, ...]:
    """The fields of a record class, resolved once per class."""
    if (known := _FIELDS.get(cls)) is not None:
        return known
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        args = get_args(hint)
        optional = get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        base = hint
        if optional:
            rest = [a for a in args if a is not type(None)]
            base = rest[0] if len(rest) == 1 else Any
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        out.append(_Field(name=f.name, base=base, optional=optional, has_default=has_default))
    _FIELDS[cls] = found = tuple(out)
    return found


def _convert(value: Any, base: Any) -> Any:
    origin = get_origin(base) or base
    if origin is str and isinstance(value, uuid.UUID):
        return str(value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if origin is bytes and isinstance(value, (memoryview, bytearray)):
        return bytes(value)
    if origin is dict and isinstance(value, Mapping) and not isinstance(value, dict):
        return dict(value)
    if origin is float and isinstance(value, (int, Decimal)) and not isinstance(value, bool):
        return float(value)
    return value


def record(cls: type[T], row: asyncpg.Record | Mapping[str, Any], /, **given: Any) -> T:
    """`cls` (a dataclass) from `row`: each field from the column of its name, converted to its
    annotation (see the module's docstring); `given` fields as they are."""
    values: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name in given:
            values[f.name] = given.pop(f.name)
            continue
        value = row.get(f.name, _MISSING)
        if value is _MISSING:
            if f.has_default:
                continue
            raise KeyError(f"{cls.__name__}.{f.name}: the row has no column {f.name!r}")
        if value is None:
            if not f.optional:
                raise TypeError(f"{cls.__name__}.{f.name}: NULL for a field that is never None")
            values[f.name] = None
            continue
        values[f.name] = _convert(value, f.base)
    if given:
        raise TypeError(f"{cls.__name__} has no fields {sorted(given)}")
    return cls(**values)
