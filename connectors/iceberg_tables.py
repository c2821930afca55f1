"""The Iceberg driver's table layer (pyiceberg): the catalog, the tables' schema and
its evolution rule, rows as Arrow, and reading the tables back.

**The catalog.** By default pyiceberg's SQL catalog in a SQLite file
`<warehouse>/catalog.db`; a REST catalog (`uri: https://…`); or a SQL catalog
elsewhere (`uri: sqlite:///…`, `postgresql…://…`). `open_catalog` opens it.

**Tables.** A view table: `_key` (the key values as a JSON list; required, the
table's identifier field), one typed column per key column and view column,
`_doc` (the whole row as JSON: what `Load` returns), `_writer` (the shard that
stored the row) and `_batch` (the batch that stored it). A delta table: `_key`,
the typed columns, `_doc`, `_writer`, `_batch` and `_seq` (the row's place in its
batch). `read_iceberg_view` and `read_iceberg_deltas` read the tables back (through
pyiceberg's scan, from `_doc`).

**Evolution rule.** A table is created at the first `Open` with `_key`, `_doc`
and the bookkeeping columns. A typed column is added (optional, before `_doc`) by
the first commit whose rows bring a non-null value for it, in the commit that
writes them: key columns, view columns, a Top-N row's own columns alike. Its type
comes from that commit's values: booleans `boolean`, integers `long`, numbers with
a fraction (or integers mixed with them) `double`, strings `string`; lists,
objects and mixed values `string` holding JSON text. A column's type never changes
afterwards: a later value it cannot hold exactly (a fraction in a `long` column, a
string in a number column) is written as null there, and `_doc` always has the
exact row. Columns are never dropped or renamed; an existing table without `_key`
and `_doc` (or a view table with `_seq`, a delta table without it) is refused at
`Open` (by the driver, `refold.connectors.iceberg`), naming the setting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.schema import Schema
from pyiceberg.table import Transaction
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
)

from refold.connectors.protocol import Binding, Key, Row, Store

BOOKKEEPING = ("_key", "_doc", "_writer", "_batch", "_seq")


# The catalog ----------------------------------------------------------------------------------


def local_folder(warehouse: str) -> Path | None:
    """The warehouse as a local folder, or None for an object-store URI (s3://, gs://, …)."""
    parts = urlsplit(warehouse)
    if parts.scheme == "file":
        return Path(parts.path)
    if parts.scheme and len(parts.scheme) > 1:  # a URI (a one-letter "scheme" is a drive)
        return None
    return Path(warehouse).expanduser()


def open_catalog(
    warehouse: str, uri: str | None = None, name: str = "refold", properties: Mapping[str, str] | None = None
) -> Catalog:
    """The catalog the tables are in: `uri` http(s)://… a REST catalog, sqlite:///… or
    postgresql…:// a SQL catalog; None: a SQLite catalog file `<warehouse>/catalog.db`."""
    local = local_folder(warehouse)
    location = local.resolve().as_uri() if local is not None else warehouse
    props = {**(properties or {}), "warehouse": location}
    if uri is None:
        if local is None:
            raise ValueError("a warehouse that is not a local folder needs a catalog uri")
        uri = f"sqlite:///{local.resolve() / 'catalog.db'}"
    if urlsplit(uri).scheme in ("http", "https"):
        from pyiceberg.catalog.rest import RestCatalog

        return RestCatalog(name, uri=uri, **props)
    from pyiceberg.catalog.sql import SqlCatalog

    try:
        return SqlCatalog(name, uri=uri, **props)
    except Exception as exc:
        # Shards open at once: SqlCatalog creates its tables when missing, and a shard
        # that loses that race gets "table … already exists"; they exist now.
        if "already exists" not in str(exc):
            raise
        return SqlCatalog(name, uri=uri, **props)


def base_schema(kind: str) -> Schema:
    """A new table's schema: `_key`, `_doc` and the bookkeeping columns (of a view or a delta table)."""
    fields = [
        NestedField(1, "_key", StringType(), required=kind == "view"),
        NestedField(2, "_doc", StringType(), required=False),
        NestedField(3, "_writer", StringType(), required=False),
        NestedField(4, "_batch", LongType(), required=False),
    ]
    if kind == "view":
        return Schema(*fields, identifier_field_ids=[1])
    return Schema(*fields, NestedField(5, "_seq", LongType(), required=False))


# Rows and columns ------------------------------------------------------------------------------


def key_json(key: Key) -> str:
    """A key as `_key` holds it: its values as a JSON list."""
    return orjson.dumps(list(key), default=str).decode()


def evolve(txn: Transaction, binding: Binding, docs: list[Row]) -> None:
    """Add the typed columns the rows bring that the table lacks (the evolution rule)."""
    have = {f.name for f in txn.table_metadata.schema().fields}
    names = dict.fromkeys([*binding.key, *binding.columns])
    for doc in docs:
        names.update(dict.fromkeys(doc))
    added: list[tuple[str, IcebergType]] = []
    for name in names:
        if name in have or name in BOOKKEEPING:
            continue
        kind = infer_type(doc.get(name) for doc in docs)
        if kind is not None:
            added.append((name, kind))
    if not added:
        return
    with txn.update_schema() as update:
        for name, kind in added:
            update.add_column((name,), kind)
            if "." not in name:
                update.move_before(name, "_doc")


def infer_type(values: Iterable[Any]) -> IcebergType | None:
    """A new column's type from its first values (None: all null, not added yet)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, bool) for v in present):
        return BooleanType()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return LongType() if all(-(2**63) <= v < 2**63 for v in present) else StringType()
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return DoubleType()
    return StringType()


def fit(value: Any, kind: IcebergType) -> Any:
    """A value as its column can hold it exactly, or None (the row's `_doc` keeps it)."""
    if value is None:
        return None
    if isinstance(kind, StringType):
        return value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    if isinstance(kind, BooleanType):
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if isinstance(kind, LongType | IntegerType):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        limit = 2**63 if isinstance(kind, LongType) else 2**31
        return value if isinstance(value, int) and -limit <= value < limit else None
    if isinstance(kind, DoubleType | FloatType):
        return float(value) if isinstance(value, int | float) else None
    return None


def arrow_rows(schema: Schema, stores: list[Store], owner: str, batch: int) -> pa.Table:
    """The rows as an Arrow table of the table's schema."""
    arrow_schema = schema.as_arrow()
    docs: list[Row] = [s.doc or {} for s in stores]
    arrays = []
    for column in schema.fields:
        name = column.name
        values: list[Any]
        if name == "_key":
            values = [key_json(s.key) for s in stores]
        elif name == "_doc":
            values = [orjson.dumps(doc).decode() for doc in docs]
        elif name == "_writer":
            values = [owner] * len(stores)
        elif name == "_batch":
            values = [batch] * len(stores)
        elif name == "_seq":
            values = list(range(len(stores)))
        else:
            values = [fit(doc.get(name), column.field_type) for doc in docs]
        arrays.append(pa.array(values, type=arrow_schema.field(name).type))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)


# Reading back ------------------------------------------------------------------------------------


def _scan(
    warehouse: str | Path,
    target: str,
    uri: str | None,
    namespace: str,
    catalog: str,
    properties: Mapping[str, str] | None,
    columns: tuple[str, ...],
) -> pa.Table:
    opened = open_catalog(str(warehouse), uri, catalog, properties)
    try:
        table = opened.load_table((*namespace.split("."), target))
        return table.scan(selected_fields=columns).to_arrow()
    finally:
        opened.close()


def read_iceberg_view(
    warehouse: str | Path,
    target: str,
    uri: str | None = None,
    *,
    namespace: str = "refold",
    catalog: str = "refold",
    properties: Mapping[str, str] | None = None,
) -> dict[Key, Row]:
    """The rows of a view table by key (from `_doc`, exactly as stored)."""
    rows = _scan(warehouse, target, uri, namespace, catalog, properties, ("_key", "_doc"))
    return {
        tuple(orjson.loads(key)): orjson.loads(doc)
        for key, doc in zip(rows.column("_key").to_pylist(), rows.column("_doc").to_pylist(), strict=True)
    }


def read_iceberg_deltas(
    warehouse: str | Path,
    target: str,
    uri: str | None = None,
    *,
    namespace: str = "refold",
    catalog: str = "refold",
    properties: Mapping[str, str] | None = None,
) -> list[Row]:
    """A delta table's rows in the order they were written: by batch, shard, place in the batch."""
    rows = _scan(warehouse, target, uri, namespace, catalog, properties, ("_writer", "_batch", "_seq", "_doc"))
    ordered = sorted(
        zip(
            rows.column("_batch").to_pylist(),
            rows.column("_writer").to_pylist(),
            rows.column("_seq").to_pylist(),
            rows.column("_doc").to_pylist(),
            strict=True,
        ),
        key=lambda row: (row[0], row[1] or "", row[2]),
    )
    return [orjson.loads(doc) for _batch, _writer, _seq, doc in ordered]
