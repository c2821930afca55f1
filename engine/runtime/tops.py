"""A global Top-N in shards: stage 2 ranks each shard's rows, stage 3 ranks the shards' tops.

A global Top-N (no `partition_by`) has one group, so routing by view key would send
every row to one stage-2 shard. In `shards: M` with M > 1 it runs in three stages:

1. **Stage 1** routes each row by its message key instead (`RouteValidator`): a row's
   copies and their retractions all have the row's message key, so each row lives in
   one stage-2 shard. Each routed record also carries its unit's id (the offset of the
   unit's first event in its source partition), so the halves of a correction that
   moves a row between shards can be put together again.
2. **Stage 2, shard m** (`ApplyProcessor` with `LocalTops`) keeps its rows ranked by
   the view's own reducer and, for each unit, writes what changed in its local top n
   to `P.tops` (one partition): the entries (row, tag) that left it, then those that
   entered it, with the unit's close, merge key and id.
3. **The driver closes `P.tops`** once every stage-2 shard committed, and **stage 3**
   (`RankProcessor`, one task, writer `<writer>.top`, transactional id
   `P-<writer>.top-0`, state in `P.tops.state`) groups what it reads by unit, orders the
   units by (close, merge key, id) — stage 2's segments in order, each merged as the
   one-shard view merges a batch — and applies each as one unit with the view's reducer
   to the entries of every shard's local top n.

Why this is the one-shard leaderboard: the view ranks entries (sort key, tag, row) and
the global top n lies within the union of the shards' local tops (an entry below n in
its shard has n entries above it in the union). Stage 3 holds that union after every
unit, so its top n, its places and its changelog are the one-shard view's. An entry
that leaves a local top is always its row's latest copy there (copies of a row rank
by tag), which is the copy the view's reducer removes for a retraction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from refold.config import Pipeline, ViewSpec
from refold.model.changelog import Op
from refold.plan import rank_pipeline, ranked_globally, tops_state_topic, tops_topic
from refold.recovery.records import PendingRecord
from refold.reduce import Rejected, SourceEvent
from refold.reduce.topn import TopNReducer
from refold.runtime.batch import InputRecord, Outgoing, Unit, Units
from refold.runtime.render import UnitChanges
from refold.runtime.shard import ShardProcessor

CLOSE_FIRST = b"{"  # a close record's value; a unit's local-top change is a JSON array


class LocalTops:
    """Stage 2's reducer for a global Top-N: the shard's rows ranked by the view's own
    reducer; `apply` returns the unit's change to the shard's top n as events for stage
    3 — each entry that left (`-R`), then each that entered (`+A`), with its row and tag."""

    def __init__(self, spec: ViewSpec) -> None:
        assert spec.top_n is not None
        self.ranks = TopNReducer(spec)
        self.n = spec.top_n.n

    def _top(self) -> dict[tuple[Any, ...], tuple[dict[str, Any], tuple[Any, ...]]]:
        """The shard's top n entries, (tag, row fingerprint) -> (row, tag), in rank order."""
        group = self.ranks.groups.get(())
        if group is None:
            return {}
        return {(tuple(tag), fp): (group.rows[fp][0], tuple(tag)) for _key, tag, fp in group.ranked[: self.n]}

    def apply(self, unit: Sequence[SourceEvent]) -> list[list[Any]]:
        """The unit applied (Rejected as the view refuses it); its local-top change as
        `[event_time, partition, offset, op, row]` events."""
        before = self._top()
        self.ranks.apply(unit)
        after = self._top()
        left = [[*tag, int(Op.RETRACT), row] for entry, (row, tag) in before.items() if entry not in after]
        entered = [[*tag, int(Op.APPEND), row] for entry, (row, tag) in after.items() if entry not in before]
        return left + entered

    def view_key(self, event: SourceEvent, index: int) -> tuple[Any, ...]:
        return self.ranks.view_key(event, index)

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        return self.ranks.state_key(event)

    def take_deltas(self) -> list[dict[str, Any]]:
        return []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        return self.ranks.take_state_changes()

    def restore(self, records: Any) -> None:
        self.ranks.restore(records)

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {}


def local_top_record(close: Any, merge_key: Any, unit_id: int, events: list[list[Any]]) -> bytes:
    """A `P.tops` record: one unit's change to one shard's local top."""
    return orjson.dumps([close, merge_key, unit_id, events])


class RankReader:
    """Stage 3's units from its `P.tops` records: each unit's changes from every shard
    together, the units in (close, merge key, id) order (see the module's docstring)."""

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        units: dict[tuple[Any, ...], list[tuple[SourceEvent, InputRecord]]] = {}
        self.causes: list[tuple[int, int]] = []  # each unit's cause: its source partition and first offset
        for record in sorted(fresh, key=lambda r: r.offset):
            value = record.value or b""
            if value[:1] == CLOSE_FIRST:
                continue
            close, merge_key, unit_id, events = orjson.loads(value)
            unit = units.setdefault((tuple(close), tuple(merge_key), unit_id), [])
            unit.extend((SourceEvent(Op(op), row, (t, p, o)), record) for t, p, o, op, row in events)
        ordered = []
        for key in sorted(units):
            # a unit's halves come in the order their shards committed: leaving entries
            # first, then entering ones, each in tag order (the result is the same in any
            # order; the order makes replays byte for byte the same)
            events = sorted(units[key], key=lambda item: (item[0].op.adds, item[0].tag))
            ordered.append(tuple(events))
            self.causes.append((key[1][1], key[2]))  # (the merge key is a tag of the unit's partition)
        return Units(ordered, {}, 0)  # (a unit here may hold more than a pair)


class RankProcessor(ShardProcessor):
    """Stage 3 (see the module's docstring): the view's one shard over `P.tops`, made
    with `rank_pipeline(pipeline)`, its state in `P.tops.state`."""

    core_reads = False  # its records are local-top changes (`RankReader`)

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int = 0, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(rank_pipeline(pipeline), settings, shard, *args, **kwargs)
        self.reader = RankReader()
        self.row_filter = None

    def _state_topic(self) -> str:
        return tops_state_topic(self.pipeline)

    def _new_core(self) -> Any:
        return None  # a Top-N reduces in Python

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        """Each unit with its cause (`RankReader.causes`): its events are entries, not it."""
        assert isinstance(self.reader, RankReader)
        changes: list[UnitChanges] = []
        for unit, cause in zip(units, self.reader.causes, strict=True):
            try:
                changes.append((self.reducer.apply([event for event, _ in unit], cause), unit[0][0].tag[0]))
            except Rejected as rejected:  # (stage 2 applied it: not expected)
                self.dead_letters.rejected(out, unit, rejected)
        return changes


__all__ = ["CLOSE_FIRST", "LocalTops", "RankProcessor", "RankReader", "local_top_record", "rank_pipeline",
           "ranked_globally", "tops_state_topic", "tops_topic"]
