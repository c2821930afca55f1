"""The Avro schemas: Refold's own (package data), users' event and row schemas.

Refold's schemas are the package `refold.schemas` (the repository's
`schemas/avro` in a checkout; inside an installed wheel too), named without
their `.avsc` (`load_schema("checkpoint")`). An event schema is a user's record
schema of row fields with the system fields of `event_system.avsc` (`op`,
`event_time`) in front: `with_system_fields` builds one, `check_system_fields`
checks one. Rows are JSON values, so Refold reads and writes Avro logical types
as their primitives (`parse_row_schema`) and refuses `bytes`/`fixed` row fields.
Every failure here is a ConfigError naming the schema.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import orjson
from fastavro import parse_schema
from fastavro.repository.base import SchemaRepositoryError
from fastavro.schema import SchemaParseException
from fastavro.schema import load_schema as _fastavro_load_schema

from refold.errors import ConfigError
from refold.model.changelog import SYSTEM_COLUMNS

# Names of the system fields an Avro event schema may carry, and the ones it must not.
EVENT_SYSTEM_FIELDS: Final = ("op", "event_time")
_RESERVED_FIELDS: Final = frozenset(SYSTEM_COLUMNS) - set(EVENT_SYSTEM_FIELDS)


def schema_dir() -> Path:
    """Refold's Avro schemas: the package `refold.schemas`, which is the repository's
    `schemas/avro` in a checkout and ships inside an installed wheel."""
    return Path(str(importlib.resources.files("refold.schemas")))


def schema_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A path as given, or a schema of `schema_dir()` by name (`"checkpoint"` or
    `"checkpoint.avsc"`) when the name has no directory part and no such file exists."""
    path = Path(name_or_path)
    if path.parent == Path(".") and not path.exists():
        return schema_dir() / (path.name if path.suffix == ".avsc" else f"{path.name}.avsc")
    return path


def load_schema(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed (fastavro) record schema of a file or of a named Refold schema.

    Cached per resolved path: treat the result as read-only. Named types defined
    in sibling `.avsc` files resolve as fastavro's `load_schema` does. Raises
    ConfigError for a missing or invalid schema.
    """
    return _load_parsed(str(schema_path(name_or_path).resolve()))


@functools.cache
def _load_parsed(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError("cannot read Avro schema: no such file", where=path)
    try:
        parsed = _fastavro_load_schema(path)
    except (OSError, SchemaRepositoryError) as exc:  # the file or a named type's sibling file
        raise ConfigError(f"cannot read Avro schema: {exc}", where=path) from exc
    except (ValueError, SchemaParseException) as exc:  # bad JSON, unknown type, bad schema
        raise ConfigError(f"not a valid Avro schema: {exc}", where=path) from exc
    if not isinstance(parsed, dict):
        raise ConfigError("the schema must be an Avro record", where=path)
    return parsed


def load_raw_schema(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of a schema file as written (not parsed by fastavro). Raises ConfigError."""
    path = schema_path(name_or_path)
    try:
        raw = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read Avro schema: {exc.strerror}", where=str(path)) from exc
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"not JSON: {exc}", where=str(path)) from exc
    if not isinstance(raw, dict):
        raise ConfigError("the schema must be an Avro record (a JSON object)", where=str(path))
    return raw


def parse_row_schema(raw: Any, where: str) -> Any:
    """A fastavro schema that reads and writes logical types as their primitives
    (rows are JSON values: timestamp-millis stays epoch ms, date days, uuid a str);
    the bytes on the wire are those of `raw`. Raises ConfigError naming `where`."""
    try:
        return parse_schema(_strip_logical_types(raw))
    except (ValueError, SchemaParseException) as exc:
        raise ConfigError(f"not a valid Avro schema: {exc}", where=where) from exc


@functools.cache
def _system_fields() -> tuple[dict[str, Any], ...]:
    return tuple(load_raw_schema("event_system")["fields"])


def with_system_fields(row_schema: Mapping[str, Any]) -> dict[str, Any]:
    """A full event schema from a record schema of row fields: the same record with
    the system fields `op` and `event_time` (nullable timestamp-millis) in front.

    Raises ConfigError when the row schema is not a record or already uses a
    system column name.
    """
    name = str(row_schema.get("name", "?"))
    fields = _record_fields(row_schema, name)
    for field in fields:
        if field.get("name") in SYSTEM_COLUMNS:
            raise ConfigError(f"row field {field.get('name')!r} is a system column name", where=name)
    out = dict(row_schema)
    out["fields"] = [dict(f) for f in _system_fields()] + [dict(f) for f in fields]
    return out


def check_system_fields(schema: Mapping[str, Any]) -> None:
    """Check that an Avro event schema (as written, not parsed) has compatible system
    fields: `op` an `int`; `event_time`, if present, a `long` or a nullable `long`,
    plain or `timestamp-millis`; no field named `offset` or `system_time`.

    Raises ConfigError naming the schema and the problem.
    """
    name = str(schema.get("name", "?"))
    fields = {f.get("name"): f for f in _record_fields(schema, name)}
    if "op" not in fields:
        raise ConfigError(
            "no field 'op': an event schema needs the system fields of "
            "schemas/avro/event_system.avsc (see refold.codecs.with_system_fields)",
            where=name,
        )
    if not _is_plain(fields["op"].get("type"), "int"):
        raise ConfigError(f"field 'op' must be an Avro int, got {fields['op'].get('type')!r}", where=name)
    if "event_time" in fields:
        kind = fields["event_time"].get("type")
        branches = kind if isinstance(kind, list) else [kind]
        non_null = [b for b in branches if b != "null"]
        if len(non_null) != 1 or len(branches) - len(non_null) > 1 or not _is_millis(non_null[0]):
            raise ConfigError(
                "field 'event_time' must be a long (optionally nullable, optionally "
                f"logicalType timestamp-millis), got {kind!r}",
                where=name,
            )
    reserved = sorted(_RESERVED_FIELDS & fields.keys())
    if reserved:
        raise ConfigError(f"field {reserved[0]!r} is a system column that outputs add; rename it", where=name)


def check_row_types(schema: Any, where: str) -> None:
    """Rows are JSON values (they are compared by their canonical JSON bytes): reject
    Avro `bytes` and `fixed` (and so `decimal`) anywhere in a row field's type.
    Raises ConfigError naming `where` (the field's dotted path)."""
    if isinstance(schema, list):
        for branch in schema:
            check_row_types(branch, where)
    elif isinstance(schema, Mapping):
        kind = schema.get("type")
        if kind in ("bytes", "fixed"):
            raise ConfigError(
                f"row field type {kind!r} is not supported: rows are JSON values "
                "(use a string, e.g. base64)",
                where=where,
            )
        if kind == "record":
            for field in schema.get("fields", []):
                check_row_types(field.get("type"), f"{where}.{field.get('name')}")
        elif kind == "array":
            check_row_types(schema.get("items"), where)
        elif kind == "map":
            check_row_types(schema.get("values"), where)
        elif isinstance(kind, (list, Mapping)):
            check_row_types(kind, where)
    elif schema in ("bytes", "fixed"):
        check_row_types({"type": schema}, where)


def _record_fields(schema: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    if schema.get("type") != "record" or not isinstance(schema.get("fields"), list):
        raise ConfigError("an event schema must be an Avro record with fields", where=name)
    fields = schema["fields"]
    if not all(isinstance(f, Mapping) for f in fields):
        raise ConfigError("every field must be a JSON object", where=name)
    return fields


def _is_plain(kind: object, primitive: str) -> bool:
    if kind == primitive:
        return True
    return isinstance(kind, Mapping) and kind.get("type") == primitive and "logicalType" not in kind


def _is_millis(kind: object) -> bool:
    if _is_plain(kind, "long"):
        return True
    return isinstance(kind, Mapping) and kind.get("type") == "long" and kind.get("logicalType") == "timestamp-millis"


def _strip_logical_types(schema: Any) -> Any:
    """The same schema without `logicalType`s: same bytes on the wire, but fastavro
    then returns (and accepts) the underlying primitives."""
    if isinstance(schema, list):
        return [_strip_logical_types(s) for s in schema]
    if isinstance(schema, Mapping):
        return {k: _strip_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    return schema
