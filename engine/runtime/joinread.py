"""A join shard's reading: both sources' records of a batch as units, merged by tag
(`JoinUnitReader`, see `refold.runtime.joins`), each side's dead letters and message-key
check, and the partition numbers that tell the sides apart (the right source's
partition p is `RIGHT_PARTITIONS` + p)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import partitions_of
from refold.plan import RIGHT_PARTITIONS, join_co_partitioned
from refold.recovery.records import PendingRecord
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing, Unit, UnitReader, Units
from refold.runtime.jointables import TableSide
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import TableItem, is_table, side_pipelines


def side_of(partition: int) -> int:
    """0 for a left source's partition, 1 for a right one's (`RIGHT_PARTITIONS` + p)."""
    return 1 if partition >= RIGHT_PARTITIONS else 0


def source_partition(partition: int) -> int:
    """A shard's partition number as its source's partition."""
    return partition - RIGHT_PARTITIONS if partition >= RIGHT_PARTITIONS else partition


def check_join_partitions(pipeline: Pipeline, settings: dict[str, Any], left: int) -> int:
    """The right source's partition count; UserError when the join is co-partitioned and
    its sources' partition counts differ (partition p of both is no longer one key range)."""
    join = pipeline.view.join
    assert join is not None
    right_topic = pipeline.sources[join.right].topic
    try:
        right = len(partitions_of(settings, right_topic))
    except UserError as exc:
        raise UserError(f"sources.{join.right}.topic: {exc}") from exc
    if join_co_partitioned(pipeline) and right != left:
        raise UserError(
            f"sources: {join.left} ({pipeline.sources[join.left].topic}) has {left} partitions and {join.right} "
            f"({right_topic}) {right}: a co-partitioned join reads partition p of both in shard p; give both "
            "topics the same partition count, or set shards: merged (one shard joins every partition)")
    return right


class SideDeadLetters(DeadLetters):
    """A side's dead letters: its topic, its records' partitions as the source's."""

    __slots__ = ()

    def add(self, out: Outgoing, record: InputRecord, reason: str, detail: str | None = None,
            headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().add(out, record._replace(partition=source_partition(record.partition)), reason, detail, headers)


def refuse_joined_row(letters: Sequence[DeadLetters], out: Outgoing, record: InputRecord, reason: str) -> None:
    """A joined row the grouped view over the join refuses (a null grouping column of a
    null-padded row): a dead letter of the source record that made it, on its side's topic."""
    letters[side_of(record.partition)].add(out, record, reason, "a joined row the view over the join refuses")


class SideKeys(KeyCheck):
    """A co-partitioned join's key check of one side: its messages keyed by its join columns."""

    def __init__(self, side: Pipeline, columns: Sequence[str]) -> None:
        super().__init__(side)
        self.columns = tuple(side.source.key) or tuple(columns)
        self._single = self.columns[0] if len(self.columns) == 1 else None
        self.enabled = True
        self.every_record = True


class JoinUnitReader:
    """Both sides' units of a batch, merged (see the module's docstring). A table side's
    records are `TableItem`s (`tables`), each a unit of one placeholder event whose
    events the shard makes against the key's last row as it joins (`item_of`)."""

    def __init__(self, pipeline: Pipeline, strict: bool, keyed: bool) -> None:
        join = pipeline.view.join
        assert join is not None
        self.letters: list[SideDeadLetters] = []
        self.readers: list[UnitReader] = []
        self.tables: list[TableSide | None] = []
        for number, (side, on) in enumerate(zip(side_pipelines(pipeline), join.sides_on, strict=True)):
            letters = SideDeadLetters(side.source.topic, pipeline.pipeline, strict)
            self.letters.append(letters)
            self.readers.append(UnitReader(side, letters, SideKeys(side, on) if keyed else None))
            self.tables.append(TableSide(side, number, letters, self.readers[-1].keys) if is_table(side) else None)
        self.keys = _BothKeys(self.readers) if keyed else None

    def item_of(self, unit: Unit) -> TableItem | None:
        """The table record of a table side's unit (None: a changelog unit)."""
        table = self.tables[side_of(unit[0][1].partition)]
        return None if table is None else table.items[unit[0][1]]

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        streams = []
        held: dict[int, PendingRecord] = {}
        tombstones = 0
        for side, reader in enumerate(self.readers):
            mine = [r for r in fresh if side_of(r.partition) == side]
            table = self.tables[side]
            if table is not None:
                streams.append(table.read(mine, out))
                tombstones += table.reader.tombstones
                continue
            read = reader.read(mine, {p: r for p, r in pending.items() if side_of(p) == side}, out)
            streams.append(read.units)
            held.update(read.pending)
            tombstones += read.tombstones
        merged = list(heapq.merge(*streams, key=lambda unit: unit[0][0].tag))
        return Units(merged, held, tombstones)


class _BothKeys:
    """Both sides' key checks as one: the Spark task marks them `verified` past a run's
    first batch (a record keyed otherwise is then a dead letter)."""

    def __init__(self, readers: Sequence[UnitReader]) -> None:
        self.checks = [reader.keys for reader in readers if reader.keys is not None]

    @property
    def verified(self) -> bool:
        return all(check.verified for check in self.checks)

    @verified.setter
    def verified(self, value: bool) -> None:
        for check in self.checks:
            check.verified = value


__all__ = ["JoinUnitReader", "SideDeadLetters", "SideKeys", "check_join_partitions", "refuse_joined_row", "side_of", "source_partition"]
