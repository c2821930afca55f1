"""Sources that are tables, as the changelog they mean: upsert topics
(`source.form: upsert`) and Debezium change events (`format: debezium-json`).

Both key each row (an upsert record by the JSON object of the message-key columns,
a Debezium event by its table's key), and both leave out what a changelog needs: an
upsert record carries no old row, a Debezium update under PostgreSQL's default
replica identity no `before`, a delete there only the key's columns. So the shard
keeps, per key, the row that key **last put into the view** (`LastRows`, in the
shard's store and `P.state` beside the reducer's state) and turns each record into
its unit at the moment it is applied, in the batch's order (each partition in offset
order, the partitions merged by tag, as every source):

| record | the key's last row | unit |
|---|---|---|
| upsert: a row | none / `old` equal to it / another `old` | `+A` row / none (counted) / `-C` old `+C` row |
| upsert: a tombstone | `old` / none | `-R` old / none (counted) |
| Debezium `c`, `r` | any | `+A` after |
| Debezium `u` | `old` | `-C` old `+C` after |
| Debezium `d` | `old` | `-R` old |

A Debezium `before` is checked against the last row: each of its columns must equal
the row's (a key-only `before` passes; a full one must be the row): else the record
is a dead letter (`before differs`). Without a last row the `before` stands for it
(it must then be the whole row, as the view checks), and an update or delete with
no `before` is a dead letter (`not live`). A Debezium record without a key (a table
without one, logged with `REPLICA IDENTITY FULL`) keeps no state: its `before` is
used as it is.

The last row changes only when the view takes the unit: a record the view refuses
(a row without its view key, a sum over a string) is dead-lettered and the key keeps
its last row, so one bad row never blocks the key's later updates. The reference
(`refold.reference.reference_table`) defines the same, from scratch.

State records: a last row is a `LAST_ROW` record (`refold.reduce.statecodec`) under
the record key `["u",[key values]]`, a tombstone when the key is deleted; it can equal
no view key's record key (those start `[[`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import orjson

from refold.codecs.base import BadRecord
from refold.codecs.debezium import debezium_change, debezium_key
from refold.codecs.upsert import UpsertDecoder, upsert_decoder
from refold.config import Pipeline
from refold.errors import RecordSource, UserError
from refold.model.changelog import Op, canonical_row
from refold.model.predicate import Condition
from refold.model.reasons import Reason
from refold.reduce import Rejected, SourceEvent, Tag
from refold.reduce.statecodec import decode_state, last_row_key, state_value
from refold.reduce.values import key_bytes
from refold.reduce.where import filter_unit
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing
from refold.runtime.render import UnitChanges
from refold.runtime.shards import KeyCheck, describe_key, message_key
from refold.state import ShardStore

UPSERT = "upsert"  # TableItem.kind of an upsert record; Debezium's are "c", "u", "d"


class TableItem(NamedTuple):
    key: tuple[Any, ...] | None  # None: a Debezium record without a key (no state)
    kind: str  # UPSERT, or Debezium's "c" (c and r), "u", "d"
    row: dict[str, Any] | None  # the new row (upsert: None for a tombstone; Debezium: after)
    before: dict[str, Any] | None  # Debezium's before image, as given
    tag: Tag
    record: InputRecord


def is_table(pipeline: Pipeline) -> bool:
    """Whether the pipeline's source is read through the last rows of its keys."""
    return pipeline.source.form == "upsert" or pipeline.source.format == "debezium-json"


def side_pipelines(pipeline: Pipeline) -> tuple[Pipeline, Pipeline]:
    """A join pipeline as each side's reader sees it: its `source` that side's."""
    join = pipeline.view.join
    assert join is not None
    return tuple(pipeline.model_copy(update={"source": pipeline.sources[name]})
                 for name in (join.left, join.right))


def joins_a_table(pipeline: Pipeline) -> bool:
    """Whether a side of the join pipeline is a table (its last rows join, in Python)."""
    return any(is_table(side) for side in side_pipelines(pipeline))


class TableReader:
    """Decodes a batch's records into `TableItem`s and merges the partitions by tag; a
    bad record is a dead letter (a Debezium tombstone is counted: `tombstones`).

    The first record of a run whose key is not what the source says (an upsert key
    that is not the JSON object of the message-key columns; for a co-partitioned view,
    a Debezium key that is not the message-key columns) stops the engine with a
    UserError, as for a changelog source."""

    def __init__(self, pipeline: Pipeline, dead_letters: DeadLetters, keys: KeyCheck | None = None) -> None:
        self.topic = pipeline.source.topic
        self.columns = message_key(pipeline)
        self.debezium = pipeline.source.format == "debezium-json"
        self.upserts = None if self.debezium else upsert_decoder(
            pipeline.source.format, pipeline.source.schema_path, self.columns
        )
        self.keys = keys if keys is not None and keys.enabled else None
        self.dead_letters = dead_letters
        self.verified = False  # a record's key was read: later bad keys are dead letters
        self.tombstones = 0

    def read(self, fresh: Sequence[InputRecord], out: Outgoing) -> list[TableItem]:
        self.tombstones = 0
        by_partition: dict[int, list[InputRecord]] = {}
        for record in fresh:
            by_partition.setdefault(record.partition, []).append(record)
        streams = [
            self._partition(sorted(by_partition[partition], key=lambda r: r.offset), out)
            for partition in sorted(by_partition)
        ]
        return list(heapq.merge(*streams, key=lambda item: item.tag))

    def _partition(self, records: Sequence[InputRecord], out: Outgoing) -> list[TableItem]:
        items: list[TableItem] = []
        for record in records:
            try:
                item = self._debezium(record) if self.debezium else self._upsert(record)
            except BadRecord as bad:
                self.dead_letters.add(out, record, bad.reason, bad.detail)
                continue
            if item is None:
                self.tombstones += 1
            else:
                items.append(item)
        return items

    def _upsert(self, record: InputRecord) -> TableItem:
        assert self.upserts is not None
        try:
            item = table_item(self.upserts, record)
        except BadRecord as bad:
            if not self.verified and bad.reason in (Reason.NULL_KEY, Reason.KEY_MISMATCH):
                try:
                    self.upserts.key_of(record.key)
                except BadRecord:
                    raise self._keyed_otherwise(record) from bad
            raise
        self.verified = True
        assert item is not None
        return item

    def _debezium(self, record: InputRecord) -> TableItem | None:
        item = table_item(None, record)
        if item is not None and self.keys is not None and not self.keys.verified:
            # UserError when keyed otherwise
            self.keys.matches(record.key, item.row or item.before or {})
        return item

    def _keyed_otherwise(self, record: InputRecord) -> UserError:
        return UserError(
            f"source.key: the messages of upsert topic {self.topic!r} are keyed {describe_key(record.key)}, "
            f"not by the JSON object of the columns {list(self.columns)} (first at "
            f"{RecordSource(self.topic, record.partition, record.offset)}); set source.key to the columns the "
            "messages are keyed by"
        )


def table_item(upserts: UpsertDecoder | None, record: InputRecord) -> TableItem | None:
    """One record of a table source as a `TableItem`: an upsert record when `upserts`
    decodes the source, else a Debezium event (None: the tombstone Debezium writes
    after a delete, for compaction). Raises BadRecord. (`refold verify` reads the
    source with it too.)"""
    if upserts is not None:
        upsert = upserts.decode(record.key, record.value)
        event_time = upsert.event_time if upsert.event_time is not None else record.timestamp
        return TableItem(upsert.key, UPSERT, upsert.row, None, (event_time, record.partition, record.offset), record)
    change = debezium_change(record.value)
    if change is None:
        return None
    event_time = change.event_time if change.event_time is not None else record.timestamp
    return TableItem(debezium_key(record.key), change.kind, change.after, change.before,
                     (event_time, record.partition, record.offset), record)


class LastRows:
    """The last row of each key the shard holds in memory (loaded from its store per
    batch), and the keys whose last row changed since `take_state_changes`."""

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], dict[str, Any] | None] = {}  # None: no row (absent)
        self._dirty: set[tuple[Any, ...]] = set()

    def __len__(self) -> int:
        return len(self.rows)

    def forget(self) -> None:
        self.rows = {}
        self._dirty = set()

    def load(self, store: ShardStore, keys: Iterable[tuple[Any, ...]], limit: int) -> None:
        """Hold the last rows of `keys` (past `limit` held keys, start empty first)."""
        keys = set(keys)
        wanted = {key for key in keys if key not in self.rows}
        if not wanted:
            return
        if len(self.rows) + len(wanted) > limit:
            self.rows = {}
            wanted = keys
        record_keys = {last_row_key(key_bytes(key)): key for key in wanted}
        for key in wanted:
            self.rows[key] = None
        for record_key, value in store.get_many(record_keys):
            self.rows[record_keys[record_key]] = decode_state(value)["values"]

    def unit(self, item: TableItem) -> list[SourceEvent]:
        """The events of one record against its key's last row ([] when it changes
        nothing). Raises Rejected when a Debezium `before` cannot be the row."""
        new, tag = item.row, item.tag
        if item.kind == "c":
            assert new is not None
            return [SourceEvent(Op.APPEND, new, tag)]
        old = self.rows[item.key] if item.key is not None else None
        if item.kind == UPSERT:
            if new is None:
                return [] if old is None else [SourceEvent(Op.RETRACT, dict(old), tag)]
            if old is None:
                return [SourceEvent(Op.APPEND, new, tag)]
            if canonical_row(old) == canonical_row(new):
                return []
            return [SourceEvent(Op.CORRECT_FROM, dict(old), tag), SourceEvent(Op.CORRECT_TO, new, tag)]
        old = _before(old, item.before)
        if item.kind == "u":
            assert new is not None
            return [SourceEvent(Op.CORRECT_FROM, old, tag), SourceEvent(Op.CORRECT_TO, new, tag)]
        return [SourceEvent(Op.RETRACT, old, tag)]

    def put(self, item: TableItem) -> None:
        """After the view took the item's unit: the key's row is the item's new row."""
        if item.key is not None:
            self.rows[item.key] = item.row if item.kind != "d" else None
            self._dirty.add(item.key)

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        for key in self._dirty:
            kj = key_bytes(key)
            row = self.rows[key]
            records.append((last_row_key(kj), None if row is None else state_value("LAST_ROW", kj, 1, row, ())))
        self._dirty = set()
        records.sort(key=lambda r: r[0])
        return records


def _before(last: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    """The row a Debezium update or delete takes out: the key's last row, checked
    against the event's `before`; the `before` itself when there is no last row."""
    if last is None:
        if before is None:
            raise Rejected(Reason.NOT_LIVE, 0, "no before image, and no row of this key in the view")
        return before
    if before is not None:
        for column, value in before.items():
            if column not in last or orjson.dumps(last[column]) != orjson.dumps(value):
                raise Rejected(Reason.BEFORE_DIFFERS, 0, f"column {column!r} differs from the key's row in the view")
    return dict(last)


def touched_by(items: Sequence[TableItem], last_rows: LastRows, store: ShardStore, pipeline: Pipeline,
               state_key: Callable[[SourceEvent], Any]) -> set[Any]:
    """The last rows of the batch's keys loaded from the store, and the view keys that
    their rows, the batch's rows and `before` images touch (for the shard to load)."""
    keys = {item.key for item in items if item.key is not None}
    last_rows.load(store, keys, pipeline.spark.state_cache_keys)
    rows = [row for item in items for row in (item.row, item.before) if row is not None]
    rows += [row for row in (last_rows.rows[key] for key in keys) if row is not None]
    touched = {state_key(SourceEvent(Op.APPEND, row, (0, 0, 0))) for row in rows}
    touched.discard(None)
    return touched


def reduce_table_rows(items: Sequence[TableItem], last_rows: LastRows, reducer: Any, row_filter: Condition | None,
                      dead_letters: DeadLetters, out: Outgoing) -> tuple[list[UnitChanges], int]:
    """Apply each record of a table source as the unit it means against its key's last
    row; a refused record is dead-lettered and leaves the last row. Also: how many
    records changed nothing."""
    changes: list[UnitChanges] = []
    unchanged = 0
    for item in items:
        try:
            events = last_rows.unit(item)
            if not events:
                unchanged += 1
                continue
            if row_filter is not None:
                events = [event for _, event in filter_unit(row_filter, events)]
            if events:  # else: the row changes, the view does not see it
                changes.append((reducer.apply(events), item.tag[0]))
        except Rejected as rejected:
            dead_letters.add(out, item.record, rejected.reason, rejected.detail)
            continue
        last_rows.put(item)
    return changes, unchanged
