"""An ingest's input: CSV, JSON lines and Parquet files (a folder or a glob of them, or
standard input), read with pyarrow in record batches, as `InputRow`s.

Every row is made JSON-native (timestamps and dates become ISO-8601 strings,
decimals strings) since that is what the topic holds and what rows compare by.
In CSV an empty cell is null and a quoted `""` the empty string. Positions: a CSV
row is named by its line (the header is line 1), a JSON-lines row
by its line, a Parquet row by its row number (from 1).
"""

from __future__ import annotations

import glob
import hashlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from refold.codecs.jsonl import event_time_from_iso
from refold.errors import UserError
from refold.ingest.merge import BadInput, InputRow

FORMATS = ("csv", "jsonl", "parquet")
_SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
             ".parquet": "parquet", ".pq": "parquet"}
_FORBIDDEN = ("op", "offset", "system_time")  # system columns an input row cannot have
BATCH_ROWS = 65_536
_BLOCK_BYTES = 8 << 20
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)


def resolve(paths: Sequence[str]) -> list[Path]:
    """The files of FILE, FOLDER (its files of a known format, sorted) and GLOB
    arguments, in order. Raises UserError for one that names nothing."""
    out: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _SUFFIXES)
            if not found:
                raise UserError(f"folder {given} has no .csv, .jsonl or .parquet files")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            matched = sorted(Path(p) for p in glob.glob(given) if Path(p).is_file())
            if not matched:
                raise UserError(f"cannot read {given}: no such file")
            out.extend(matched)
    return out


def spool_stdin(directory: Path) -> Path:
    """Standard input copied to a file (so it can be hashed, checked whole, then read)."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="stdin-", delete=False) as handle:
        shutil.copyfileobj(sys.stdin.buffer, handle, 1 << 20)
    return Path(handle.name)


def format_of(path: Path, given: str | None) -> str:
    if given:
        return given
    found = _SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise UserError(f"cannot tell the format of {path} from its name: give --format csv|jsonl|parquet")
    return found


def content_hash(paths: Sequence[Path], *parts: object) -> str:
    """SHA-256 of the files' bytes, in order, and of `parts` (the options that change
    what the bytes mean): an ingest's identity when it has no name."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(orjson.dumps(part))
    for path in paths:
        digest.update(b"\x00file\x00")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _batches(path: Path, fmt: str) -> Iterator[pa.RecordBatch]:
    if fmt == "csv":
        # an empty cell is null, a quoted empty string "" is the empty string (PostgreSQL's COPY)
        convert = pacsv.ConvertOptions(strings_can_be_null=True, quoted_strings_can_be_null=False)
        reader: Any = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=_BLOCK_BYTES),
                                     convert_options=convert)
        yield from reader
    else:
        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)


def _blank(path: Path) -> bool:
    """Whether the file has nothing but white space (read only as far as it takes to see)."""
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _forbidden(event_time_column: str | None) -> frozenset[str]:
    """The columns an input row may not have: the system columns but `event_time`, and
    that too when another column is the event time."""
    if event_time_column and event_time_column != "event_time":
        return frozenset({*_FORBIDDEN, "event_time"})
    return frozenset(_FORBIDDEN)


def _system_column(column: str) -> str:
    return (f"column {column!r} is a system column: an ingest takes rows, not events "
            "(`refold produce` writes a changelog as it is)")


_JSON_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}


def _jsonl_rows(path: Path, name: str, kinds: dict[str, tuple[str, str]], forbidden: frozenset[str],
                tombstones: bool) -> Iterator[tuple[dict[str, Any], str, bool]]:
    """(row, where, deleted) per non-blank line. JSON lines are parsed as written (by
    orjson, not pyarrow, whose type inference would turn ISO-8601 strings into
    timestamps and name a bad line only within its block)."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{name}:line {number}"
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise BadInput(where, f"not JSON: {exc}") from exc
            if type(row) is not dict:
                raise BadInput(where, f"not a JSON object but a JSON {type(row).__name__}")
            if tombstones and len(row) == 2 and row.get("value", 0) is None and type(row.get("key")) is dict:
                yield row["key"], where, True
                continue
            for column, value in row.items():
                if column in forbidden:
                    raise BadInput(where, _system_column(column))
                if value is None:
                    continue
                kind = _JSON_KINDS.get(type(value), "other")
                before = kinds.setdefault(column, (kind, where))
                if before[0] != kind:
                    raise BadInput(where, f"column {column!r} is {kind} here but {before[0]} "
                                          f"at {before[1]}: its type changed")
            yield row, where, False


def _kind(kind: pa.DataType) -> str:
    """The JSON kind an Arrow type becomes: what a column's type may not change from."""
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return "number"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_boolean(kind):
        return "boolean"
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind) or pa.types.is_time(kind):
        return "time"
    if pa.types.is_null(kind):
        return "null"
    return str(kind)


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _needs_plain(schema: pa.Schema) -> bool:
    return any(_kind(f.type) not in ("number", "string", "boolean", "null") or pa.types.is_decimal(f.type)
               for f in schema)


def _event_time(value: Any, where: str, column: str) -> int:
    if isinstance(value, bool) or value is None:
        raise BadInput(where, f"event time column {column!r} is {'null' if value is None else value}")
    if isinstance(value, int):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return (value - _EPOCH) // _ONE_MS
    if isinstance(value, date):
        return (datetime(value.year, value.month, value.day, tzinfo=UTC) - _EPOCH) // _ONE_MS
    if isinstance(value, str):
        try:
            return event_time_from_iso(value)
        except ValueError:
            pass
    raise BadInput(where, f"event time column {column!r} is {value!r}, not epoch milliseconds nor ISO-8601")



def read_rows(
    paths: Sequence[Path],
    fmt: str | None,
    *,
    now: int,
    event_time_column: str | None = None,
    deleted_column: str | None = None,
    tombstones: bool = False,
    names: Sequence[str] | None = None,
) -> Iterator[InputRow]:
    """Every row of every file, in order. `names[i]` names `paths[i]` in messages
    (standard input: `<stdin>`). With `tombstones` (an upsert), a JSON line
    `{"key": {...}, "value": null}` (what `refold consume` prints for a tombstone) is a
    deleted row of that key. Raises BadInput for a row or a column it cannot take."""
    kinds: dict[str, tuple[str, str]] = {}  # column → (kind, where first seen)
    for number, path in enumerate(paths):
        name = names[number] if names is not None else str(path)
        file_format = format_of(path, fmt)
        first_line = 2 if file_format == "csv" else 1
        label = "row" if file_format == "parquet" else "line"
        seen = 0
        if file_format == "jsonl":
            for row, where, deleted in _jsonl_rows(path, name, kinds, _forbidden(event_time_column), tombstones):
                yield (InputRow(row, where, now, deleted=True) if deleted
                       else _input_row(row, where, now, event_time_column, deleted_column))
            continue
        if _blank(path):  # no rows (an empty snapshot); pyarrow's readers refuse empty files
            continue
        batches = _batches(path, file_format)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:
                where = f"{name}: after {label} {seen + first_line - 1}" if seen else name
                raise BadInput(where, f"cannot read it as {file_format}: {exc}") from exc
            start = f"{name}:{label} {seen + first_line}" if file_format != "parquet" else f"{name}: row {seen + 1}"
            forbidden = _forbidden(event_time_column)
            for field in batch.schema:
                if field.name in forbidden:
                    raise BadInput(start, _system_column(field.name))
                kind = _kind(field.type)
                if kind == "null":
                    continue
                before = kinds.setdefault(field.name, (kind, start))
                if before[0] != kind:
                    raise BadInput(start, f"column {field.name!r} is {kind} here but {before[0]} "
                                          f"at {before[1]}: its type changed")
            plain = _needs_plain(batch.schema)
            for row in batch.to_pylist():
                where = (f"{name}: row {seen + 1}" if file_format == "parquet"
                         else f"{name}:{label} {seen + first_line}")
                seen += 1
                if plain:
                    stamp = row.get(event_time_column) if event_time_column else None
                    row = orjson.loads(orjson.dumps(row, default=_plain, option=orjson.OPT_NAIVE_UTC))
                    if isinstance(stamp, datetime | date) and event_time_column:
                        row[event_time_column] = stamp
                yield _input_row(row, where, now, event_time_column, deleted_column)


def _input_row(row: dict[str, Any], where: str, now: int, event_time_column: str | None,
               deleted_column: str | None) -> InputRow:
    event_time = now
    if event_time_column:
        if event_time_column not in row:
            raise BadInput(where, f"event time column {event_time_column!r} is missing")
        event_time = _event_time(row[event_time_column], where, event_time_column)
        value = row[event_time_column]
        if isinstance(value, datetime | date | time):
            row[event_time_column] = value.isoformat()
        if event_time_column == "event_time":
            del row["event_time"]
    elif "event_time" in row:  # the system column, as `refold produce` reads it
        value = row.pop("event_time")
        event_time = now if value is None else _event_time(value, where, "event_time")
    deleted = False
    if deleted_column:
        flag = row.pop(deleted_column, None)
        deleted = flag is True or flag == 1 or (isinstance(flag, str) and flag.lower() in ("true", "1", "yes", "y"))
    return InputRow(row, where, event_time, deleted)
