"""A join through the exchange (`view.join` with `shards: M`): stage 1 routes both
sources' units by join key, the driver closes, stage 2's M shards join.

The exchange of a re-grouping view (`refold.runtime.exchange`), with a join's two
sources:

1. **Stage 1, shard p** (`JoinRouteProcessor`, writer `<writer>`, transactional id
   `P-<writer>-<p>`): reads partition p of both sources (the right one's numbered
   `RIGHT_PARTITIONS + p`, as a join's shards number it), decodes and pairs each side
   with its own source's settings, merges both sides' units by tag
   (`refold.runtime.joinread.JoinUnitReader`) and sends each unit to `P.repartition`
   partition `shard_of(join key)` (`refold.runtime.exchange.shard_of` of the side's
   join columns' values), one record per shard it touches, with its events' tags and
   its merge key, as stage 1 of a re-grouping view writes them. It holds no join
   state: a retraction of a row the side does not hold is refused by stage 2, which
   holds the rows. A table side (`form: upsert`, `debezium-json`) keeps each message
   key's last row here, in the shard's store and `P.rows` partition p (as a merged
   join's shard keeps them, `refold.runtime.jointables`), and routes the events its
   record makes against it (a new key `+A`, a changed row `-C`/`+C`, a tombstone `-R`).
   One transaction: the routed records, the dead letters of records that do not decode,
   the last rows' changes, the checkpoint, both sources' offsets.
2. **The driver closes the batch** (`Closer`), as for a re-grouping view.
3. **Stage 2, shard m** (`JoinApplyProcessor`, writer `<writer>.view`): reads partition
   m of `P.repartition` through the close (`read_closed`), merges each segment by merge
   key (`ExchangeReader`) and joins each unit as a join's shard does (the native
   `JoinCore` or the `JoinReducer`; the grouped view over the join in the same shard
   when its key holds the left side's join columns, so each view key lies in one shard;
   keyed elsewhere, the joined rows go on by view key to a stage 3:
   `refold.runtime.joingroup`).
   Its dead letters name the side's topic, the event's source partition and offset
   (its value is the event as JSON: the source record stays in the source topic);
   each record it writes names the source event that caused it.

A correction that moves a row to another join key in another shard arrives as two
halves, the `-C` in one shard and the `+C` in the other: each shard writes what its
half changes (a `-R` of the old joined rows, a `+A` of the new), in two transactions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from refold.config import Pipeline
from refold.connectors.runtime import Executor, Materializations
from refold.plan import regroups_join, stage2_shards, view_pipeline
from refold.recovery.records import PendingRecord
from refold.reduce import Rejected
from refold.reduce.values import key_bytes
from refold.runtime.batch import InputRecord, Outgoing, Unit, Units
from refold.runtime.exchange import ExchangeReader, shard_of
from refold.runtime.joingroup import JoinedRouter, source_record
from refold.runtime.joinread import SideDeadLetters, side_of
from refold.runtime.joins import JoinShardProcessor
from refold.runtime.render import UnitChanges

__all__ = ["JoinApplyProcessor", "JoinExchangeReader", "JoinRouteProcessor", "JoinRouter"]


class JoinRouter:
    """Stage 1's reducer: no state; routes a unit by each event's join key."""

    def __init__(self, pipeline: Pipeline) -> None:
        join = pipeline.view.join
        assert join is not None
        self.on = join.sides_on
        self.shards = stage2_shards(pipeline)
        self.view: Any = None

    def routed(self, unit: Unit, merge_key: list[Any]) -> list[tuple[int, bytes]]:
        """The unit's records: (P.repartition partition, value) for each shard it touches."""
        by_shard: dict[int, list[list[Any]]] = {}
        for event, _record in unit:
            columns = self.on[side_of(event.tag[1])]
            try:
                key = key_bytes(tuple(event.row.get(column) for column in columns))
            except (TypeError, orjson.JSONEncodeError):  # (stage 2's join refuses the row: any shard will do)
                key = b""
            shard = shard_of(key, self.shards)
            by_shard.setdefault(shard, []).append([*event.tag, int(event.op), event.row])
        return [(shard, orjson.dumps([merge_key, events])) for shard, events in by_shard.items()]

    def take_deltas(self) -> list[dict[str, Any]]:
        return []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        return []

    def restore(self, records: Any) -> None:
        pass


class JoinRouteProcessor(JoinShardProcessor):
    """Stage 1's shard p of a join through the exchange (see the module's docstring)."""

    core_reads = False  # (it routes units: `JoinUnitReader` reads them)

    def _state_topic(self) -> str:
        return self.pipeline.rows_topic  # (stage 1 keeps no state: nothing is written there)

    def _new_reducer(self) -> Any:
        return JoinRouter(self.pipeline)

    def _new_materializations(self, executor: Executor | None) -> Materializations | None:
        return None

    def _touched(self, units: Sequence[Unit]) -> set[Any]:
        """No view keys; a table side's keys' last rows loaded from the store."""
        if any(self.reader.tables):
            assert self.store is not None
            keys = {item.key for unit in units if (item := self.reader.item_of(unit)) is not None
                    and item.key is not None}
            self.last_rows.load(self.store, keys, self.pipeline.spark.state_cache_keys)
        return set()

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        """Each unit routed with its merge key: the greatest first tag of the shard's units
        up to its own (`refold.runtime.exchange.merge_keys`; both sides' units are one
        stream here, merged by tag). A table side's record is routed as the events it
        makes against its key's last row, which it then replaces."""
        greatest: Any = None
        for unit in units:
            first = unit[0][0].tag
            if greatest is None or first > greatest:
                greatest = first
            item = self.reader.item_of(unit)
            if item is not None:
                try:
                    events = self.last_rows.unit(item)
                except Rejected as rejected:  # (a Debezium `before` that cannot be the row)
                    self.reader.letters[side_of(item.record.partition)].add(out, item.record, rejected.reason,
                                                                            rejected.detail)
                    continue
                self.last_rows.put(item)
                if not events:
                    continue
                unit = tuple((event, item.record) for event in events)
            out.route(self.reducer.routed(unit, list(greatest)))
        return []

    def _render(self, changes: Sequence[UnitChanges], out: Outgoing) -> None:
        out.state = self.last_rows.take_state_changes()  # (a table side's last rows, in P.rows)


class JoinExchangeReader(ExchangeReader):
    """Stage 2's units, each event with a record of its own that names its source
    partition (numbered as a join's shards number them) and offset: the join takes its
    side from it, and a dead letter names them. `letters`: each side's dead letters."""

    def __init__(self, letters: Sequence[SideDeadLetters]) -> None:
        super().__init__()
        self.letters = list(letters)
        self.tables = [None, None]  # (no table sides: a join through the exchange reads changelogs)
        self.order: dict[tuple[int, int], list[Any]] = {}  # a unit's (partition, offset) -> [its close, merge key]

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        read = super().read(fresh, pending, out)
        self.order = {}
        for unit in read.units:
            close, merge_key, _id = self.meta[unit[0][1].offset]
            self.order[unit[0][0].tag[1:]] = [close, merge_key]
        units = [tuple((event, source_record(event)) for event, _record in unit) for unit in read.units]
        return Units(units, read.pending, read.tombstones)


class JoinApplyProcessor(JoinShardProcessor):
    """Stage 2's shard m of a join through the exchange (see the module's docstring)."""

    core_reads = False  # (its records are routed units)

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int = 0, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(view_pipeline(pipeline), settings, shard, *args, **kwargs)
        self.regroup = JoinedRouter(self.pipeline) if regroups_join(self.pipeline) else None

    def _make_reader(self) -> Any:
        return JoinExchangeReader(super()._make_reader().letters)

    def _new_reducer(self) -> Any:
        reducers = super()._new_reducer()
        if regroups_join(self.pipeline):  # the grouped view is stage 3's (refold.runtime.joingroup)
            reducers.grouped = reducers.grouped_core = None
        return reducers

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        joined = super()._reduce(units, out)
        if self.regroup is None:
            return joined
        self.regroup.route(self.reader, units, joined, out)  # (stage 3 reduces them)
        return []

    def _consumed(self, offsets: Mapping[int, int]) -> dict[str, dict[int, int]]:
        return {self.topic: dict(offsets)}
