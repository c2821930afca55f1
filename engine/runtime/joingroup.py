"""A join in `shards: M` whose grouped view is keyed outside the join key: the joined
rows through a second exchange, by view key, to a stage 3 that reduces the view.

"Orders joined with customers, summed by region": the join shards hold each join key's
rows, but a region's joined rows come out of every join shard. So the exchanged join
(`refold.runtime.joinx`) gets a third stage, as a re-grouping view's stage 2 follows its
stage 1 (`refold.runtime.exchange`):

1. **Stage 1** routes both sources' units by join key through `P.repartition`, as
   for any join in shards.
2. **Stage 2, shard m** (`JoinApplyProcessor`, writer `<writer>.view`) joins its units
   (its join state in `P.state` partition m) and, instead of reducing, checks each
   joined unit as the grouped view would (its view key, its summed columns: a refused
   one is a dead letter of the source record, as a merged join's) and sends it to
   `P.regroup` partition `shard_of(view key)` (`JoinedRouter`): one record per shard it
   touches, its events tagged with the source unit's tag, with its order key (the
   stage-1 close and merge key of its source unit, the unit's partition and offset,
   its index among the unit's joined units). One transaction: the routed records, the
   dead letters, the join's state, the checkpoint, the `P.repartition` offsets.
3. **The driver closes `P.regroup`** once every stage-2 shard committed (`Closer`).
4. **Stage 3, shard m** (`RegroupProcessor`, writer `<writer>.group`, transactional id
   `P-<writer>.group-m`): reads `P.regroup` partition m through the close
   (`read_closed`), orders each segment's units by their order key (`RegroupReader`:
   the order the one-shard join met them in, a function of the committed records, so a
   replay gets the same units in the same order) and reduces them with the view's
   native `GroupedCore` where `spark.core` allows (`join_view_core`, as a merged join's
   view; its `GroupedReducer` otherwise), committing the view, deltas, its state (`P.regroup.state`
   partition m) and its checkpoint with its `P.regroup` offsets. Each record names the
   source event that caused it (`JoinRenderer`).

Each stage commits in its own transactions with its own offsets, so each is exactly
once on its own; a replayed stage reads what the stage before committed, which is
fixed. A region's joined rows from two join shards commit in two stage-2 transactions
but reach stage 3 in one segment, in the one-shard order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from refold.config import Pipeline
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.plan import regroup_pipeline, regroup_state_topic, regroup_topic, stage2_shards
from refold.recovery.records import PendingRecord
from refold.reduce import Rejected, SourceEvent
from refold.reduce.grouped import GroupedReducer
from refold.reduce.types import cause_of
from refold.reduce.values import key_bytes
from refold.runtime.batch import InputRecord, Outgoing, Unit, Units
from refold.runtime.exchange import shard_of
from refold.runtime.joinread import SideDeadLetters, refuse_joined_row, side_of
from refold.runtime.joins import JoinChanges, JoinRenderer, as_units
from refold.runtime.native import join_view_core
from refold.runtime.render import Renderer, UnitChanges
from refold.runtime.shard import ShardProcessor
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import TableReader, side_pipelines
from refold.runtime.tops import CLOSE_FIRST

__all__ = ["JoinedRouter", "RegroupProcessor", "RegroupReader", "source_record"]


def grouped_reducer(pipeline: Pipeline) -> GroupedReducer:
    """The grouped view over the join, as a merged join's shard reduces it."""
    return GroupedReducer(pipeline.view.model_copy(update={"join": None, "sql": None}))


def source_record(event: SourceEvent) -> InputRecord:
    """The source record of an event read from an exchange (what its dead letter names:
    its partition numbered as a join's shards number it, its offset, the event as JSON)."""
    _time, partition, offset = event.tag
    return InputRecord(partition, offset, None, orjson.dumps({"op": Op(event.op).code, **event.row}), None)


class JoinedRouter:
    """Stage 2's routing of its joined units by view key into `P.regroup`."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.checks = grouped_reducer(pipeline)
        self.shards = stage2_shards(pipeline)
        self.topic = regroup_topic(pipeline)

    def route(self, reader: Any, units: Sequence[Unit], joined: Sequence[tuple[JoinChanges, int]],
              out: Outgoing) -> None:
        """Each unit's joined records (`joined`, as the join made them) as the grouped
        view's units, checked and routed; `reader`: stage 2's `JoinExchangeReader`."""
        out.exchange_topic = self.topic
        by_cause = {cause_of(unit[0][0].tag): unit for unit in units}
        for made, _time in joined:
            unit = by_cause[made.cause]
            tag = unit[0][0].tag
            close, merge_key = reader.order[tag[1:]]
            for index, sub in enumerate(as_units(made, tag)):
                try:
                    keys = [self.checks.view_key(event, i) for i, event in enumerate(sub)]
                except Rejected as rejected:
                    reader.letters[side_of(tag[1])].add(out, unit[0][1], rejected.reason,
                                                        "a joined row the view over the join refuses")
                    continue
                by_shard: dict[int, list[list[Any]]] = {}
                for event, key in zip(sub, keys, strict=True):
                    by_shard.setdefault(shard_of(key_bytes(key), self.shards), []).append(
                        [*event.tag, int(event.op), event.row])
                order = [close, merge_key, tag[1], tag[2], index]
                for shard, events in by_shard.items():
                    out.exchange.setdefault(shard, []).append(orjson.dumps([order, events]))


class RegroupReader:
    """Stage 3's units from its `P.regroup` records: segment by segment (between close
    records), each ordered by its units' order keys. `letters`: each side's dead letters."""

    def __init__(self, letters: Sequence[SideDeadLetters]) -> None:
        self.letters = list(letters)
        self.keys = None

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        units: list[Unit] = []
        segment: list[tuple[list[Any], Unit]] = []
        for record in sorted(fresh, key=lambda r: r.offset):
            value = record.value or b""
            if value[:1] == CLOSE_FIRST:
                units.extend(unit for _order, unit in sorted(segment, key=lambda item: item[0]))
                segment = []
                continue
            order, events = orjson.loads(value)
            unit = tuple((SourceEvent(Op(op), row, (t, p, o)), record) for t, p, o, op, row in events)
            segment.append((order, unit))
        units.extend(unit for _order, unit in sorted(segment, key=lambda item: item[0]))
        return Units(units, {}, 0)


class RegroupProcessor(ShardProcessor):
    """Stage 3's shard m of a regrouping join (see the module's docstring): the grouped
    view over `P.regroup` partition m, made with `regroup_pipeline(pipeline)`."""

    core_reads = False

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int = 0, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(regroup_pipeline(pipeline), settings, shard, *args, **kwargs)
        self.row_filter = None  # (a join's rows are not filtered by view.where: as a merged join's view)

    def _parts(self, keys: KeyCheck | None) -> tuple[Any, TableReader | None, Renderer]:
        letters = [SideDeadLetters(side.source.topic, self.pipeline.pipeline, self.pipeline.strict)
                   for side in side_pipelines(self.pipeline)]
        return RegroupReader(letters), None, JoinRenderer(self.pipeline)

    def _state_topic(self) -> str:
        return regroup_state_topic(self.pipeline)

    def _new_reducer(self) -> Any:
        return grouped_reducer(self.pipeline)

    def _new_core(self) -> Any:
        return join_view_core(self.pipeline, self.pipeline.spark.core)  # (as a merged join's view)

    def _refused(self, out: Outgoing, unit: Unit, index: int, reason: str, shown: Sequence[Any]) -> None:
        # (stage 2 checked it: not expected)
        refuse_joined_row(self.reader.letters, out, source_record(unit[0][0]), Reason(reason))

    def _new_materializations(self, executor: Any) -> None:
        return None  # (a join's materializations are refused: Pipeline.run_refusal)

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        changes: list[UnitChanges] = []
        for unit in units:
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as rejected:  # (stage 2 checked it: not expected)
                refuse_joined_row(self.reader.letters, out, source_record(unit[0][0]), rejected.reason)
        return changes
