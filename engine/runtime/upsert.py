"""An upsert source as the changelog it means (`source.form: upsert`).

Each record of an upsert source is message key → latest row, or a tombstone. The
shard keeps, per message key, the row that key last put into the view (`LastRows`,
in the shard's store and `P.state` beside the reducer's state), and turns each record
into events at the moment it is applied, in the batch's order (partition by
partition in offset order, merged by tag as every source is):

| the key's last row | the record | events |
|---|---|---|
| none | a row | `+A` row |
| `old` | a row equal to `old` | none (counted) |
| `old` | another row | `-C` old, `+C` row (one unit) |
| `old` | a tombstone | `-R` old |
| none | a tombstone | none (counted) |

The last row changes only when the view takes the unit: a record the view refuses
(a row without its view key, a sum over a string) is dead-lettered and the key keeps
its last row, so one bad row never blocks the key's later updates. The reference
(`refold.reference.reference_upsert`) defines the same, from scratch.

State records: a last row is a `LAST_ROW` record (`refold.reduce.statecodec`) under
the record key `["u",[key values]]`, a tombstone when the key is deleted; it can equal
no view key's record key (those start `[[`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from refold.codecs.base import BadRecord
from refold.codecs.upsert import UpsertDecoder, upsert_decoder
from refold.config import Pipeline
from refold.errors import RecordSource, UserError
from refold.model.changelog import Op, canonical_row
from refold.reduce import SourceEvent, Tag
from refold.reduce.statecodec import decode_state, last_row_key, state_value
from refold.reduce.values import key_bytes
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing
from refold.runtime.shards import describe_key, message_key
from refold.state import ShardStore


class UpsertItem(NamedTuple):
    key: tuple[Any, ...]  # the message key's values
    row: dict[str, Any] | None  # None: a tombstone
    tag: Tag
    record: InputRecord


class UpsertReader:
    """Decodes a batch's upsert records and merges the partitions by tag; a bad record
    is a dead letter. The first record of a run whose key is not the JSON object of the
    message-key columns stops the engine (a UserError), as for a changelog source."""

    def __init__(self, pipeline: Pipeline, dead_letters: DeadLetters) -> None:
        self.topic = pipeline.source.topic
        self.columns = message_key(pipeline)
        self.decoder: UpsertDecoder = upsert_decoder(pipeline.source.format, pipeline.source.schema_path, self.columns)
        self.dead_letters = dead_letters
        self.verified = False  # a record's key was read: later bad keys are dead letters

    def read(self, fresh: Sequence[InputRecord], out: Outgoing) -> list[UpsertItem]:
        by_partition: dict[int, list[InputRecord]] = {}
        for record in fresh:
            by_partition.setdefault(record.partition, []).append(record)
        streams = [
            self._partition(sorted(by_partition[partition], key=lambda r: r.offset), out)
            for partition in sorted(by_partition)
        ]
        return list(heapq.merge(*streams, key=lambda item: item.tag))

    def _partition(self, records: Sequence[InputRecord], out: Outgoing) -> list[UpsertItem]:
        items: list[UpsertItem] = []
        decode = self.decoder.decode
        for record in records:
            try:
                upsert = decode(record.key, record.value)
            except BadRecord as bad:
                if not self.verified and _key_unreadable(self.decoder, record.key):
                    raise UserError(
                        f"source.key: the messages of upsert topic {self.topic!r} are keyed "
                        f"{describe_key(record.key)}, not by the JSON object of the columns {list(self.columns)} "
                        f"(first at {RecordSource(self.topic, record.partition, record.offset)}); set source.key "
                        "to the columns the messages are keyed by"
                    ) from bad
                self.dead_letters.add(out, record, bad.reason, bad.detail)
                continue
            self.verified = True
            event_time = upsert.event_time if upsert.event_time is not None else record.timestamp
            items.append(UpsertItem(upsert.key, upsert.row, (event_time, record.partition, record.offset), record))
        return items


def _key_unreadable(decoder: UpsertDecoder, key: bytes | None) -> bool:
    try:
        decoder.key_of(key)
    except BadRecord:
        return True
    return False


class LastRows:
    """The last row of each message key the shard holds in memory (loaded from its
    store per batch), and the keys whose last row changed since `take_state_changes`."""

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
        wanted = {key for key in keys if key not in self.rows}
        if not wanted:
            return
        if len(self.rows) + len(wanted) > limit:
            self.rows = {}
            wanted = set(keys)
        found = store.get_many([last_row_key(key_bytes(key)) for key in wanted])
        for key in wanted:
            self.rows[key] = None
        for value in found:
            record = decode_state(value)
            self.rows[record["key"]] = record["values"]

    def events(self, item: UpsertItem) -> list[SourceEvent]:
        """The events of one record against the key's last row ([] when it changes
        nothing)."""
        old = self.rows[item.key]
        new = item.row
        if new is None:
            return [] if old is None else [SourceEvent(Op.RETRACT, dict(old), item.tag)]
        if old is None:
            return [SourceEvent(Op.APPEND, new, item.tag)]
        if canonical_row(old) == canonical_row(new):
            return []
        return [SourceEvent(Op.CORRECT_FROM, dict(old), item.tag), SourceEvent(Op.CORRECT_TO, new, item.tag)]

    def put(self, key: tuple[Any, ...], row: dict[str, Any] | None) -> None:
        self.rows[key] = row
        self._dirty.add(key)

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        records: list[tuple[bytes, bytes | None]] = []
        for key in self._dirty:
            kj = key_bytes(key)
            row = self.rows[key]
            records.append((last_row_key(kj), None if row is None else state_value("LAST_ROW", kj, 1, row, ())))
        self._dirty = set()
        records.sort(key=lambda r: r[0])
        return records

