"""The Delta driver's table layer (delta-rs): the tables' layout and the typed columns'
evolution rule, rows as Arrow, and reading the tables (and their log) back.

**Tables.** Each binding is one Delta table, `<path>/<target>` (`table_uri`: a local
folder or an object-store URI), partitioned by `_writer`, the shard that owns the rows:

- **view table** `(_writer, _key, _doc, _batch, <typed key and view columns>)`: one row
  per live view key. `_key` is the key values as a JSON list (`key_json`, the merge
  key), `_doc` the whole row as JSON (what `Load` returns, exactly: `read_docs`),
  `_batch` the batch that last wrote the row.
- **delta table** `(_writer, _batch, _seq, _key, _doc, <typed columns>)`: the delta rows,
  appended; `_seq` is the row's place in its batch, so `(_batch, _writer, _seq)` is the
  order they were written in.

`read_delta_view(path, target)` and `read_delta_deltas(path, target)` read them back
(from `_key`/`_doc`); any Delta reader sees the typed columns. `find_checkpoint` finds
the runtime checkpoint a writer committed with a batch in the table's history (the
commit metadata `refold.app_id`, `refold.batch`, `refold.checkpoint`, newest first).

**Typed columns and their evolution.** The table is created with the fixed columns
only; each key and view column (and a Top-N row's own columns) is added when a batch
first carries a non-null value for it (`schema_mode=merge`, in that batch's commit),
typed from the batch's values: all booleans → boolean, all integers → long, integers
and floats → double, anything else (strings, lists, objects, mixed) → string, with
non-strings as JSON text. Columns are only added, never dropped, renamed or retyped;
rows from before read null. A later value that does not fit the column's type (a
float in a long column, a string in a boolean one) is written as null there; `_doc`
always holds the exact row. Names that are not plain identifiers (letters, digits,
`_`), differ only by case from an existing column, or clash with the fixed columns
live in `_doc` only. `arrow_rows` applies the rule to a batch's rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, QueryBuilder

from refold.connectors.protocol import Binding, Key, Row, RuntimeCheckpoint, Store

WRITER, KEY, DOC, BATCH, SEQ, DELETED = "_writer", "_key", "_doc", "_batch", "_seq", "_deleted"
VIEW_SCHEMA = pa.schema([(WRITER, pa.string()), (KEY, pa.string()), (DOC, pa.string()), (BATCH, pa.int64())])
DELTA_SCHEMA = pa.schema(
    [(WRITER, pa.string()), (BATCH, pa.int64()), (SEQ, pa.int64()), (KEY, pa.string()), (DOC, pa.string())]
)
_RESERVED = {WRITER, KEY, DOC, BATCH, SEQ, DELETED}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HISTORY = (64, 4096, None)  # commits read back (newest first) to find our last checkpoint


def table_uri(path: str, target: str) -> str:
    """`<path>/<target>`: a local folder, or an object-store URI."""
    if is_uri(path):
        return path.rstrip("/") + "/" + target
    return str(Path(path).expanduser() / target)


def is_uri(path: str) -> bool:
    return "://" in path


def key_json(key: Key) -> str:
    """A key as `_key` holds it: its values as a JSON list, in the binding's key order."""
    return orjson.dumps(list(key), default=str).decode()


# Rows as Arrow -----------------------------------------------------------------------------------


def arrow_rows(
    table: DeltaTable,
    binding: Binding,
    stores: Sequence[Store],
    checkpoint: RuntimeCheckpoint,
    *,
    deleted: bool = False,
    seq: bool = False,
) -> pa.Table:
    """The rows of `stores` in the table's schema, plus the typed columns it does not have yet."""
    schema = pa.schema(table.schema().to_arrow())
    count = len(stores)
    columns: dict[str, pa.Array] = {
        WRITER: pa.array([checkpoint.writer] * count, pa.string()),
        KEY: pa.array([key_json(s.key) for s in stores], pa.string()),
        DOC: pa.array([None if s.doc is None else orjson.dumps(s.doc).decode() for s in stores], pa.string()),
        BATCH: pa.array([checkpoint.batch] * count, pa.int64()),
    }
    if seq:
        columns[SEQ] = pa.array(range(count), pa.int64())
    known = {f.name.lower(): f for f in schema}
    positions = {name: i for i, name in enumerate(binding.key)}
    for name in _candidates(binding, stores):
        if not _NAME.fullmatch(name) or name.lower() in _RESERVED or name in columns:
            continue
        at = positions.get(name)
        values = [s.key[at] if at is not None else (s.doc or {}).get(name) for s in stores]
        existing = known.get(name.lower())
        if existing is not None:
            if existing.name == name:  # one differing only by case lives in _doc only
                columns[name] = _convert(values, existing.type)
            continue
        kind = _infer(values)
        if kind is not None:  # a column arrives with its first value
            columns[name] = _convert(values, kind)
            known[name.lower()] = pa.field(name, kind)
    names = [f.name for f in schema] + [name for name in columns if schema.get_field_index(name) < 0]
    arrays = [columns[name] if name in columns else pa.nulls(count, schema.field(name).type) for name in names]
    if deleted:
        names.append(DELETED)
        arrays.append(pa.array([s.delete for s in stores], pa.bool_()))
    return pa.Table.from_arrays(arrays, names=names)


def _candidates(binding: Binding, stores: Iterable[Store]) -> list[str]:
    """Column names in order: the key, the view's columns, then those rows bring (Top-N)."""
    seen = dict.fromkeys([*binding.key, *binding.columns])
    for store in stores:
        for name in store.doc or ():
            seen.setdefault(name)
    return list(seen)


_INT64 = (-(2**63), 2**63 - 1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _infer(values: Sequence[Any]) -> pa.DataType | None:
    """A new column's type from its first values (None: no value yet)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, bool) for v in present):
        return pa.bool_()
    if all(_is_int(v) for v in present):
        return pa.int64() if all(_INT64[0] <= v <= _INT64[1] for v in present) else pa.string()
    if all(_is_int(v) or isinstance(v, float) for v in present):
        return pa.float64()
    return pa.string()


def _convert(values: Sequence[Any], kind: pa.DataType) -> pa.Array:
    """Values as a column of `kind`; one that does not fit is null (`_doc` has it)."""
    fit: Callable[[Any], Any]
    if pa.types.is_boolean(kind):
        fit = lambda v: v if isinstance(v, bool) else None  # noqa: E731
    elif pa.types.is_integer(kind):
        bits = kind.bit_width
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if pa.types.is_signed_integer(kind) else (0, 2**bits - 1)
        fit = lambda v: v if _is_int(v) and low <= v <= high else None  # noqa: E731
    elif pa.types.is_floating(kind):
        fit = lambda v: float(v) if _is_int(v) or isinstance(v, float) else None  # noqa: E731
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        fit = lambda v: v if isinstance(v, str) else orjson.dumps(v, default=str).decode()  # noqa: E731
    else:  # a type this driver does not make (the table was altered): what converts
        fit = lambda v: _scalar(v, kind)  # noqa: E731
    return pa.array([None if v is None else fit(v) for v in values], kind)


def _scalar(value: Any, kind: pa.DataType) -> Any:
    try:
        return pa.scalar(value, kind).as_py()
    except (pa.ArrowException, TypeError, ValueError):
        return None


def empty_rows(table: DeltaTable) -> pa.Table:
    """No rows, in the table's schema (for a commit that changes nothing)."""
    return pa.schema(table.schema().to_arrow()).empty_table()


# Reading -------------------------------------------------------------------------------------------


def read_docs(table: DeltaTable, writer: str, keys: set[str]) -> dict[str, Row]:
    """`_doc` by `_key` of the asked keys in the writer's partition. The scan filters
    in memory: delta-rs writes some files with string_view columns, whose statistics
    pyarrow's dataset filter cannot compare."""
    if not keys:
        return {}
    wanted = pa.array(sorted(keys), pa.string())
    dataset = table.to_pyarrow_dataset(file_pruning_predicate=[(WRITER, "=", writer)])
    found: dict[str, Row] = {}
    for batch in dataset.to_batches(columns=[KEY, DOC]):
        column = batch.column(0).cast(pa.string())
        hits = pc.is_in(column, value_set=wanted)
        for key, doc in zip(pc.filter(column, hits).to_pylist(), pc.filter(batch.column(1), hits).to_pylist(),
                            strict=True):
            found[key] = orjson.loads(doc)
    return found


def find_checkpoint(table: DeltaTable, app: str, batch: int) -> bytes | None:
    """The runtime checkpoint committed with `batch` by `app`, from the table's history."""
    for limit in _HISTORY:
        history = table.history(limit)
        for commit in history:  # newest first
            if commit.get("refold.app_id") == app and str(commit.get("refold.batch")) == str(batch):
                held = commit.get("refold.checkpoint")
                return held.encode() if isinstance(held, str) else None
        if limit is None or len(history) < limit:
            break
    return None


def _read_columns(table: DeltaTable, columns: list[str]) -> pa.Table:
    """The table's `columns`, read by delta-rs itself (its query engine), not by Arrow's
    dataset scan: that scan reads through delta-rs's Python filesystem from Arrow's I/O
    threads (also with `use_threads=False`), and one such thread still alive when the
    interpreter exits is torn down by `std::terminate` — a process that read a table and
    exited (the demo, a test's reader) aborted in 1 to 8 runs of 30."""
    names = ", ".join(f'"{column}"' for column in columns)
    reader = QueryBuilder().register("refold_read", table).execute(f"SELECT {names} FROM refold_read")
    return pa.table(reader.read_all())


def read_delta_view(path: str | Path, target: str, storage_options: dict[str, str] | None = None) -> dict[Key, Row]:
    """The rows of a view table by key (from `_doc`, exactly as stored)."""
    table = DeltaTable(table_uri(str(path), target), storage_options=storage_options)
    data = _read_columns(table, [KEY, DOC])
    return {
        tuple(orjson.loads(key)): orjson.loads(doc)
        for key, doc in zip(data.column(KEY).to_pylist(), data.column(DOC).to_pylist(), strict=True)
    }


def read_delta_deltas(path: str | Path, target: str, storage_options: dict[str, str] | None = None) -> list[Row]:
    """A delta table's rows in the order they were written (by batch, writer, place)."""
    table = DeltaTable(table_uri(str(path), target), storage_options=storage_options)
    data = _read_columns(table, [BATCH, WRITER, SEQ, DOC])
    rows = sorted(zip(*(data.column(c).to_pylist() for c in (BATCH, WRITER, SEQ, DOC)), strict=True))
    return [orjson.loads(doc) for _batch, _writer, _seq, doc in rows]
