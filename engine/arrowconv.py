"""`ChangelogEvent`s ⇄ Arrow tables (for Spark, Parquet and pandas).

A table has the system columns `op` (`uint8`, 0..3) and `event_time`
(`timestamp[ms]`, UTC, null when unknown) first, then one column per row
column, in order of first appearance. Row column types are inferred by Arrow
unless a `row_schema` is given.

The round trip `arrow_to_events(events_to_arrow(events)) == events` holds when
every row has the same columns and each column has one JSON type. Otherwise,
as Arrow has no "absent": a column a row lacks comes back as `None`, and a
column mixing ints and floats becomes `double` (ints come back as floats, which
are different values under `canonical_row`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from refold.changelog import SYSTEM_COLUMNS, ChangelogEvent, Op

OP_TYPE = pa.uint8()
EVENT_TIME_TYPE = pa.timestamp("ms")
_OPS = tuple(Op)
_PER_MS = {"ms": 1, "us": 1_000, "ns": 1_000_000}


def events_to_arrow(events: Iterable[ChangelogEvent], row_schema: pa.Schema | None = None) -> pa.Table:
    """A table of events. `row_schema` fixes the row columns and their types (rows
    may then hold no other column). Raises ValueError for a row with a system
    column, a column Arrow cannot type, or a column outside `row_schema`."""
    events = list(events)
    if row_schema is not None:
        names = list(row_schema.names)
    else:
        seen: dict[str, None] = {}
        for event in events:
            for name in event.row:
                seen.setdefault(name, None)
        names = list(seen)
    clash = sorted(SYSTEM_COLUMNS.intersection(names))
    if clash:
        raise ValueError(f"rows hold non-system columns only, found {clash}")
    if row_schema is not None:
        allowed = set(names)
        for event in events:
            extra = [name for name in event.row if name not in allowed]
            if extra:
                raise ValueError(f"row columns {extra} are not in the row schema")
    arrays: list[pa.Array] = [
        pa.array([int(e.op) for e in events], type=OP_TYPE),
        pa.array([e.event_time for e in events], type=EVENT_TIME_TYPE),
    ]
    fields = [pa.field("op", OP_TYPE, nullable=False), pa.field("event_time", EVENT_TIME_TYPE)]
    for name in names:
        values = [e.row.get(name) for e in events]
        wanted = row_schema.field(name).type if row_schema is not None else None
        try:
            array = pa.array(values, type=wanted)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"column {name!r}: {exc}") from exc
        arrays.append(array)
        fields.append(row_schema.field(name) if row_schema is not None else pa.field(name, array.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def arrow_to_events(table: pa.Table) -> list[ChangelogEvent]:
    """The events of a table with an `op` column (integers 0..3, or codes as
    strings) and optionally `event_time` (a timestamp of any unit, floored to ms,
    or integer epoch ms). Columns `offset` and `system_time` are dropped; every
    other column is a row column. Raises ValueError for a null or bad op."""
    if "op" not in table.column_names:
        raise ValueError("the table has no 'op' column")
    ops = _ops(table.column("op"))
    count = table.num_rows
    if "event_time" in table.column_names:
        times = _millis(table.column("event_time"))
    else:
        times = [None] * count
    names = [name for name in table.column_names if name not in SYSTEM_COLUMNS]
    columns = [table.column(name).to_pylist() for name in names]
    rows: Iterable[dict[str, Any]] = (
        (dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True))
        if names
        else ({} for _ in range(count))
    )
    return [ChangelogEvent(op, row, t) for op, row, t in zip(ops, rows, times, strict=True)]


def _ops(column: pa.ChunkedArray) -> list[Op]:
    if pa.types.is_integer(column.type):
        return [_OPS[v] if v is not None and 0 <= v <= 3 else _bad_op(v) for v in column.to_pylist()]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return [Op.parse(v) for v in column.to_pylist()]
    raise ValueError(f"column 'op' must hold integers 0..3 or op codes, not {column.type}")


def _bad_op(value: object) -> Op:
    raise ValueError(f"op must be one of +A, -R, -C, +C or 0..3, got {value!r}")


def _millis(column: pa.ChunkedArray) -> list[int | None]:
    kind = column.type
    if pa.types.is_timestamp(kind):
        raw: list[int | None] = column.cast(pa.int64()).to_pylist()
        if kind.unit == "s":
            return [None if v is None else v * 1000 for v in raw]
        per_ms = _PER_MS[kind.unit]
        return raw if per_ms == 1 else [None if v is None else v // per_ms for v in raw]  # floor
    if pa.types.is_integer(kind):
        return column.cast(pa.int64()).to_pylist()
    raise ValueError(f"column 'event_time' must be a timestamp or epoch milliseconds, not {kind}")
