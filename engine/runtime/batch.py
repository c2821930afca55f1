"""A batch from input records to units: decode each partition, pair `-C`/`+C`, merge.

Guarantees of `UnitReader.read`:

- Units come in the order to apply them: each partition's in offset order, the
  partitions merged by the tag of each unit's first event (`event_time`, partition,
  offset), so the order is a function of the batch's records.
- Every input record ends up in exactly one place: in a unit, in `Outgoing.dlq` (a
  dead letter with its reason), counted as a tombstone (a record with no change, e.g.
  a Debezium tombstone), or held over: a `-C` at the end of its partition's records
  waits, raw, in the checkpoint's `pending` for its `+C` in the next batch, where it
  is replayed in front of its partition's records.
- In strict mode the first refused record raises its RecordError instead.
- A co-partitioned view's records are checked against their message keys
  (`refold.runtime.shards.KeyCheck`): a record keyed otherwise is a dead letter
  (`key mismatch`), or, as the first record of a run, stops the engine (UserError).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

from refold.codecs import source_decoder
from refold.config import Pipeline
from refold.errors import RecordError, RecordSource
from refold.model.changelog import ChangelogEvent, Op, Pairing
from refold.model.reasons import Reason
from refold.recovery.records import DeadLetter, PendingRecord
from refold.reduce import Rejected, SourceEvent
from refold.runtime.shards import KeyCheck


class InputRecord(NamedTuple):
    """One Kafka record of the source topic, as the Spark job hands it over."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int  # epoch ms


Item = tuple[SourceEvent, InputRecord]
Unit = tuple[Item] | tuple[Item, Item]  # an event alone, or a -C and its +C


@dataclass(slots=True)
class Outgoing:
    """The records of one batch, in the order they will be produced."""

    # (key, value, event time, headers): the headers name each record's cause (refold.runtime.render)
    view: list[tuple[bytes, bytes | None, int | None, list[tuple[str, bytes]] | None]] = field(default_factory=list)
    delta: list[tuple[bytes, bytes, list[tuple[str, bytes]] | None]] = field(default_factory=list)
    dlq: list[DeadLetter] = field(default_factory=list)
    state: list[tuple[bytes, bytes | None]] = field(default_factory=list)
    delta_rows: list[dict[str, Any]] = field(default_factory=list)  # for delta materializations
    exchange: dict[int, list[bytes]] = field(default_factory=dict)  # P.repartition partition -> routed units
    exchange_topic: str | None = None  # where `exchange` goes: P.repartition unless set (a stage 2's P.tops)

    def route(self, routed: Iterable[tuple[int, bytes]]) -> None:
        """Routed records (P.repartition partition, value), after those already here."""
        exchange = self.exchange
        for partition, value in routed:
            exchange.setdefault(partition, []).append(value)

    def by_topic(self, pipeline: Pipeline) -> dict[str, int]:
        """How many records go to each output topic and the dead-letter topic."""
        counts: dict[str, int] = {}
        if pipeline.outputs.view is not None:
            counts[pipeline.outputs.view.topic] = len(self.view)
        if pipeline.outputs.delta is not None:
            counts[pipeline.outputs.delta.topic] = len(self.delta)
        counts[pipeline.dlq_topic] = len(self.dlq)
        return counts


@dataclass(slots=True)
class BatchStats:
    """What a shard's batch (or, summed, a batch of every shard) read and wrote."""

    batch: int = 0
    records_in: int = 0
    records_out: int = 0
    dead_letters: int = 0
    skipped: int = 0
    tombstones: int = 0  # records that carry no change (Debezium tombstones): counted, not applied
    seconds: float = 0.0
    commit_seconds: float = 0.0  # begin_transaction to commit_transaction
    committed_at: float = 0.0
    out_by_topic: dict[str, int] = field(default_factory=dict)
    shards: int = 1  # how many shards committed a part of the batch


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """Where refused input records go: `Outgoing.dlq`, or in strict mode a RecordError
    naming the record."""

    topic: str
    pipeline: str
    strict: bool

    def add(
        self, out: Outgoing, record: InputRecord, reason: str, detail: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if self.strict:
            raise RecordError(reason, RecordSource(self.topic, record.partition, record.offset), detail=detail)
        out.dlq.append(
            DeadLetter(
                reason=reason,
                detail=detail,
                topic=self.topic,
                partition=record.partition,
                offset=record.offset,
                timestamp=record.timestamp,
                key=record.key,
                value=record.value,
                pipeline=self.pipeline,
                headers=headers,
            )
        )

    def rejected(self, out: Outgoing, unit: Sequence[Item], rejected: Rejected) -> None:
        """`refuse` of a unit the reducer refused: a windowed view's own refusals (`late`,
        `bad event time`) with their detail and headers; the others' details stay out."""
        shown = rejected.reason in (Reason.LATE, Reason.BAD_TIME)
        self.refuse(out, unit, rejected.index, rejected.reason, rejected.detail if shown else None, rejected.headers)

    def refuse(
        self, out: Outgoing, unit: Sequence[Item], refused_index: int, reason: str, detail: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """A unit the reducer refused: one dead letter per input record (a Debezium update
        is a pair from one record) — the refused event's with `reason` (and `detail`,
        `headers`), the other half of a refused pair as such."""
        refused = unit[refused_index][1]
        for index, (_event, record) in enumerate(unit):
            if index == refused_index:
                self.add(out, record, reason, detail, headers)
            elif record is not refused:
                self.add(out, record, Reason.CORRECTION_PAIR_REJECTED)


class Units(NamedTuple):
    units: list[Unit]  # in the order to apply them
    pending: dict[int, PendingRecord]  # partition -> its held-over -C, for the checkpoint
    tombstones: int


_OFFSET = itemgetter(1)  # an InputRecord's offset


def partitions(
    fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord]
) -> tuple[list[tuple[int, list[InputRecord]]], dict[int, PendingRecord]]:
    """The batch's records by partition, partitions in order, each one's in offset order
    after the `-C` it held over; and what stays held of the partitions the batch has
    no record of."""
    by_partition: dict[int, list[InputRecord]] = {}
    for record in fresh:
        by_partition.setdefault(record.partition, []).append(record)
    pending_out = dict(pending)
    parts = []
    for partition in sorted(by_partition):
        rows = sorted(by_partition[partition], key=_OFFSET)
        held = pending_out.pop(partition, None)
        if held is not None:
            rows.insert(0, InputRecord(partition, held.offset, held.key, held.value, held.timestamp))
        parts.append((partition, rows))
    return parts, pending_out


def held_over(record: InputRecord) -> PendingRecord:
    """A `-C` at the end of its partition's records, for the checkpoint."""
    return PendingRecord(record.offset, record.key, record.value or b"", record.timestamp)


class UnitReader:
    """Decodes, pairs and merges a batch's records (see the module's docstring)."""

    def __init__(self, pipeline: Pipeline, dead_letters: DeadLetters, keys: KeyCheck | None = None) -> None:
        self.topic = pipeline.source.topic
        self.decoder = source_decoder(pipeline)
        self.dead_letters = dead_letters
        self.keys = keys if keys is not None and keys.enabled else None  # None: nothing to check

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        """The units of `fresh` (records no checkpoint covers yet), after the `-C`s
        `pending` held over from the last batch."""
        parts, pending_out = partitions(fresh, pending)
        streams = []
        tombstones = 0
        for partition, rows in parts:
            units, unpaired, dropped = self._partition(partition, rows, out)
            if unpaired is not None:  # its +C comes in a later batch
                pending_out[partition] = held_over(unpaired)
            streams.append(units)
            tombstones += dropped
        merged = list(heapq.merge(*streams, key=lambda unit: unit[0][0].tag))
        return Units(merged, pending_out, tombstones)

    def _partition(
        self, partition: int, rows: Sequence[InputRecord], out: Outgoing
    ) -> tuple[list[Unit], InputRecord | None, int]:
        """One partition's units in offset order, its `-C` left unpaired at the end, and
        how many tombstones it had."""
        decoded = self.decoder.decode_records(
            [r.value for r in rows], [r.offset for r in rows], topic=self.topic, partition=partition
        )
        pairing: Pairing[Item] = Pairing()
        units: list[Unit] = []
        tombstones = 0
        keys = self.keys
        for record, result in zip(rows, decoded, strict=True):
            if isinstance(result, RecordError):
                self.dead_letters.add(out, record, result.reason, result.detail)
                self._unpaired(pairing.release(), out)  # a bad record cannot be the +C
            elif not result:
                tombstones += 1  # changes nothing, breaks no pair
            elif keys is not None and not keys.matches(record.key, result[0].row):
                self.dead_letters.add(out, record, Reason.KEY_MISMATCH, f"not keyed by {list(keys.columns)}")
                self._unpaired(pairing.release(), out)
            else:
                for event in result:
                    item = (_source_event(record, event), record)
                    op = event.op
                    if (op is Op.APPEND or op is Op.RETRACT) and pairing.idle:  # most events: no pair to settle
                        units.append((item,))
                        continue
                    step = pairing.feed(op, record.key, item)
                    self._unpaired(step.unpaired, out)
                    if step.orphan is not None:
                        self.dead_letters.add(out, record, Reason.ORPHAN_CORRECT_TO)
                    elif step.unit is not None:
                        units.append(step.unit)
        held = pairing.release()
        return units, held[1] if held is not None else None, tombstones

    def _unpaired(self, held: Item | None, out: Outgoing) -> None:
        if held is not None:
            self.dead_letters.add(out, held[1], Reason.UNPAIRED_CORRECT_FROM)


def _source_event(record: InputRecord, event: ChangelogEvent) -> SourceEvent:
    event_time = event.event_time if event.event_time is not None else record.timestamp
    row = event.row  # decoders make a fresh dict per event; other mappings are copied
    return SourceEvent(event.op, row if type(row) is dict else dict(row), (event_time, record.partition, record.offset))
