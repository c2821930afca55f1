"""The live rows of a topic, folded from its own changelog: what an ingest diffs against.

Kafka is the truth: an ingest, a correction and a retraction read the topic's
committed changelog (read_committed) to its end and fold it, event by event, into
the multiset of live rows (docs/SEMANTICS.md): `+A`/`+C` add a copy of a row,
`-R`/`-C` remove one copy of an equal row (`canonical_row`). A unit the engine
would refuse (a retraction of a row that is not live, a `-C` without its `+C`, an
undecodable value) changes nothing here either, and is counted.

The rows are grouped by their primary-key columns (or, without a primary key, by
the whole row) and kept in RocksDB in a temporary directory (`LocalTable`), so a
topic larger than memory folds in bounded memory. The group key is the bytes the
ingest writes as the message key: the JSON object of the primary-key columns
(`message_key_bytes`), or the row's canonical bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import orjson
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from refold import environment
from refold.codecs import JsonlCodec
from refold.codecs.base import BadRecord
from refold.errors import RecordSource
from refold.kafka.io import read_to_end
from refold.model.changelog import Op, Pairing, canonical_row
from refold.model.reasons import Reason

Row = dict[str, Any]


class LocalTable:
    """Sorted bytes → bytes in RocksDB under a fresh temporary directory (removed on
    `close`): for state an ingest must not hold in memory. Not thread-safe.

    Puts and deletes collect in a small buffer (read through by `get`) and go to
    RocksDB in write batches of `BUFFERED` entries: one native call per batch instead
    of one per entry."""

    BUFFERED = 20_000

    def __init__(self, root: Path | None = None, prefix: str = "refold-ingest-", *,
                 directory: Path | None = None) -> None:
        """A fresh table under `root`, removed on `close`; or, given `directory`, the
        table kept there (the caller holds its lock and removes it when it must)."""
        self.keep = directory is not None
        if directory is None:
            base = root or environment.home() / "tmp"
            base.mkdir(parents=True, exist_ok=True)
            directory = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        self._db: Rdict | None = Rdict(str(self.directory), options)
        unlogged = WriteOptions()
        # scratch state, rebuilt from Kafka: no write-ahead log (a property; the stub says method)
        unlogged.disable_wal = True  # type: ignore[method-assign,assignment]
        self._db.set_write_options(unlogged)
        self._pending: dict[bytes, bytes | None] = {}  # key → value, None: deleted

    def _rdb(self) -> Rdict:
        if self._db is None:
            raise ValueError(f"the local table {self.directory} is closed")
        return self._db

    def get(self, key: bytes) -> bytes | None:
        pending = self._pending
        if key in pending:
            return pending[key]
        value = self._rdb().get(key)
        return None if value is None else bytes(value)

    def put(self, key: bytes, value: bytes) -> None:
        self._pending[key] = value
        if len(self._pending) >= self.BUFFERED:
            self._write()

    def delete(self, key: bytes) -> None:
        self._pending[key] = None
        if len(self._pending) >= self.BUFFERED:
            self._write()

    def _write(self) -> None:
        """The buffered puts and deletes to RocksDB, in one write batch."""
        if not self._pending:
            return
        batch = WriteBatch(raw_mode=True)
        for key, value in self._pending.items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        self._rdb().write(batch)
        self._pending.clear()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every entry, by key (everything put before this call)."""
        self._write()
        return cast(Iterator[tuple[bytes, bytes]], iter(self._rdb().items()))  # raw mode: bytes

    def flush(self) -> None:
        """Everything put so far on disk (there is no write-ahead log)."""
        self._write()
        self._rdb().flush(wait=True)

    def close(self) -> None:
        if self._db is not None:
            self._write()
        db, self._db = self._db, None
        if db is not None:
            db.close()
            del db
        if not self.keep:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalTable:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class MemoryTable:
    """`LocalTable`'s contract in a dict (sorted on `items`): a test double, and for inputs
    known to be small."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        self._data[key] = value

    def delete(self, key: bytes) -> None:
        del self._data[key]

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(sorted(self._data.items()))

    def close(self) -> None:
        self._data.clear()

    def __enter__(self) -> MemoryTable:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


Table = LocalTable | MemoryTable


def group_of(row: Mapping[str, Any], key_columns: Sequence[str]) -> bytes | None:
    """The group (and message) key of a row: the JSON object of its primary-key columns,
    None when one is missing or null; without key columns, the row's canonical bytes."""
    if not key_columns:
        return canonical_row(row)
    key = {}
    for column in key_columns:
        value = row.get(column)
        if value is None:
            return None
        key[column] = value
    return orjson.dumps(key)  # = message_key_bytes(key_columns, values)


@dataclass
class FoldReport:
    """What folding a topic met: records read, units refused (as the engine refuses
    them) with the first one's position and reason."""

    records: int = 0
    refused: int = 0
    first_refused: str | None = None
    ends: dict[int, int] = field(default_factory=dict)  # partition → next offset to read
    held: dict[int, int] = field(default_factory=dict)  # partition → offset of a -C the end cut from its +C

    def refuse(self, where: str, reason: str) -> None:
        self.refused += 1
        if self.first_refused is None:
            self.first_refused = f"{where}: {reason}"


class LiveRows:
    """Per group key, the live copies of rows (usually one), in a `LocalTable`."""

    def __init__(self, key_columns: Sequence[str], table: Table) -> None:
        self.key_columns = tuple(key_columns)
        self.table = table

    def copies(self, group: bytes) -> list[Row]:
        value = self.table.get(group)
        return [] if value is None else list(orjson.loads(value))

    def groups(self) -> Iterator[tuple[bytes, list[Row]]]:
        """Every group with live rows, by group key."""
        for group, value in self.table.items():
            yield group, list(orjson.loads(value))

    def encoded_groups(self) -> Iterator[tuple[bytes, bytes]]:
        """Every group with live rows, by group key, its copies as stored: the JSON list
        of its rows (one row: `b"[" + orjson.dumps(row) + b"]"`)."""
        return self.table.items()

    def add(self, row: Mapping[str, Any]) -> Reason | None:
        """`apply([(Op.APPEND, row)])`, the common case, without the trial copy."""
        group = group_of(row, self.key_columns)
        if group is None:
            return Reason.NULL_KEY
        value = self.table.get(group)
        self.table.put(group, b"[" + orjson.dumps(row) + b"]" if value is None
                       else orjson.dumps([*orjson.loads(value), row]))
        return None

    def apply(self, unit: Sequence[tuple[Op, Row]]) -> Reason | None:
        """Apply a unit (one event, or a `-C` and its `+C`) whole, or nothing of it and
        return why (`null key`, `not live`)."""
        if len(unit) == 1 and unit[0][0].adds:  # the common case: one row added
            return self.add(unit[0][1])
        trial: dict[bytes, list[Row]] = {}
        for op, row in unit:
            group = group_of(row, self.key_columns)
            if group is None:
                return Reason.NULL_KEY
            copies = trial.get(group)
            if copies is None:
                copies = trial[group] = self.copies(group)
            if op.adds:
                copies.append(row)
                continue
            wanted = canonical_row(row)
            match = [i for i, copy in enumerate(copies) if canonical_row(copy) == wanted]
            if not match:
                return Reason.NOT_LIVE
            copies.pop(match[-1])  # the latest copy goes
        for group, copies in trial.items():
            if copies:
                self.table.put(group, orjson.dumps(copies))
            elif self.table.get(group) is not None:
                self.table.delete(group)
        return None


def fold_topic(settings: Mapping[str, Any], topic: str, live: LiveRows,
               start: Mapping[int, int] | None = None) -> FoldReport:
    """Fold `topic`'s committed changelog, from the beginning (or the offsets `start`)
    to its current end, into `live`. Each partition's `-C` pairs with the `+C` right
    after it (`Pairing`); a refused unit changes nothing and is counted in the report.
    A `-C` the end cuts from its `+C` is left unapplied and unrefused (`held`): the
    next fold starts at it."""
    events_of = JsonlCodec()._events_of  # the one parser call per record (raises BadRecord)
    add = live.add
    report = FoldReport(ends=dict(start or {}))
    pairings: dict[int, Pairing[_Held]] = {}
    for msg in read_to_end(settings, topic, start=start):
        partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
        report.records += 1
        report.ends[partition] = offset + 1
        pairing = pairings.get(partition)
        if pairing is None:
            pairing = pairings[partition] = Pairing()
        value = msg.value()
        if value is None:  # a tombstone: not an event of a changelog topic
            report.refuse(f"{topic}[{partition}]@{offset}", Reason.UNDECODABLE)
            _settle(topic, report, pairing.release(), None)
            continue
        try:
            event = events_of(value)[0]
        except BadRecord as bad:
            error = bad.error(value, RecordSource(topic, partition, offset))
            report.refuse(f"{topic}[{partition}]@{offset}", error.reason)
            _settle(topic, report, pairing.release(), None)
            continue
        if event.op is Op.APPEND and pairing.idle:  # a unit of its own, settling nothing
            reason = add(event.row)
            if reason is not None:
                report.refuse(f"{topic}[{partition}]@{offset}", reason)
            continue
        step = pairing.feed(event.op, msg.key(), (event.op, dict(event.row), partition, offset))
        if step.unpaired is not None or step.orphan is not None:
            _settle(topic, report, step.unpaired, step.orphan)
        if step.unit is not None:
            reason = live.apply([(item[0], item[1]) for item in step.unit])
            if reason is not None:
                first = step.unit[0]
                report.refuse(f"{topic}[{first[2]}]@{first[3]}", reason)
    for partition, pairing in pairings.items():
        held = pairing.release()
        if held is not None:
            report.held[partition] = held[3]
    return report


_Held = tuple[Op, Row, int, int]  # an event, its partition and offset


def _settle(topic: str, report: FoldReport, unpaired: _Held | None, orphan: _Held | None) -> None:
    if unpaired is not None:
        report.refuse(f"{topic}[{unpaired[2]}]@{unpaired[3]}", Reason.UNPAIRED_CORRECT_FROM)
    if orphan is not None:
        report.refuse(f"{topic}[{orphan[2]}]@{orphan[3]}", Reason.ORPHAN_CORRECT_TO)
