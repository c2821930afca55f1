"""A join's shard (`view.join`, docs/SEMANTICS.md "Joins"): both sources' records in one
batch, joined, and the grouped view over the join when the view has `key`/`columns`.

A join shard reads both sources. Its records number the right source's partition p
`RIGHT_PARTITIONS + p` (`refold.plan`): the Spark job's frame does so, and so do the
shard's checkpoint (`offsets`, `pending`: one record covers both topics) and its causes.
Each side is decoded with its own source's settings (format, schema) and paired in
partition offset order, as any source; the units of both are then merged by tag
(`event_time`, partition, offset), so at equal event times the left source's come
before the right's: the order is a function of the batch's records.

Each unit goes to the join's reducer with its side; its records (`Changes`, caused by the
unit's first event) are the view's, or, for a grouped view over the join, its input
units (a `-C` with its `+C`, tagged with the source unit's tag, so every record the
grouped view writes names the source event as its cause). The batch is two passes:
the join keys the units touch are loaded from the store and every unit joined, then the
view keys the joined records touch are loaded and reduced. Join and view share the
shard's store and `P.state` partition (join records `["j",…]`, view records `[[…]`).

The join reduces on the native `JoinCore` where `spark.core` allows
(`refold.runtime.native.join_reducer`), and the grouped view over it on the native
`GroupedCore` (`join_view_core`), which writes the view, delta and state records itself.
With both native and neither side a table, the batch goes from one core to the other in
one call (`GroupedCore.join_read`): the joined records never become Python objects. And
when, besides, both sides are `jsonl` changelogs and the join is not co-partitioned, the
view's core reads the batch's records itself (`read_join`, as `read` reads a grouped
view's: a batch it does not take clean goes through the Python readers), the join's core
joins them (`join_kept`): no Python object per event at all. A
value a core does not hold raises `Unsupported` before the unit changes anything; the
shard then drops the batch's work (nothing is sent yet), joins (or reduces the view) in
Python until its next start, reloads the touched keys from its store and joins the batch's
units again.

Dead letters name the side's own topic, partition and offset. A joined row the grouped
view refuses (a null grouping column of a null-padded row: `null key`) is a dead letter
of the source record that caused it. Provenance headers name `<topic>:<partition>:<offset>`
(a join has two sources).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refold.config import Pipeline
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.plan import RIGHT_PARTITIONS, join_co_partitioned
from refold.recovery.records import DeadLetter, PendingRecord
from refold.reduce import Rejected, SourceEvent, ViewChange
from refold.reduce.grouped import GroupedReducer
from refold.reduce.join import JoinReducer, state_prefix
from refold.reduce.types import Cause, cause_of
from refold.reduce.values import key_bytes
from refold.runtime.batch import (
    InputRecord,
    Outgoing,
    Unit,
    held_over,
    partitions,
)
from refold.runtime.joinread import (
    JoinUnitReader,
    refuse_joined_row,
    side_of,
    source_partition,
)
from refold.runtime.native import Unsupported, join_reducer, join_view_core, reads_natively
from refold.runtime.render import Renderer
from refold.runtime.shard import ShardProcessor
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import joins_a_table, side_pipelines

log = logging.getLogger(__name__)


class JoinReducers:
    """The join and, over it, the grouped view (when the view has `key`/`columns`)."""

    def __init__(self, pipeline: Pipeline, core: str | None = None, view_core: str | None = None) -> None:
        """`core`, `view_core`: `spark.core` for the join and for the grouped view over it
        (the pipeline's when None; `python`: a `JoinReducer`, a `GroupedReducer`)."""
        assert pipeline.view.join is not None
        self.join: Any = join_reducer(pipeline.view.join, core or pipeline.spark.core)
        view = pipeline.view
        # the grouped view's native core, or (None) `grouped` reduces it in Python
        self.grouped_core = join_view_core(pipeline, view_core or pipeline.spark.core) if view.key else None
        self.grouped = (GroupedReducer(view.model_copy(update={"join": None, "sql": None}))
                        if view.key and self.grouped_core is None else None)
        self.view: Any = None  # (no materializations of a join)

    @property
    def has_view(self) -> bool:
        """Whether a grouped view over the join reduces here (on either core)."""
        return self.grouped_core is not None or self.grouped is not None

    def take_deltas(self) -> list[dict[str, Any]]:
        return self.grouped.take_deltas() if self.grouped is not None else []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        grouped = self.grouped.take_state_changes() if self.grouped is not None else []
        return self.join.take_state_changes() + grouped


class JoinRenderer(Renderer):
    """Causes as `<topic>:<partition>:<offset>`: a join has two sources."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__(pipeline)
        join = pipeline.view.join
        assert join is not None
        self.topics = (pipeline.sources[join.left].topic, pipeline.sources[join.right].topic)

    def name_cause(self, cause: Cause) -> bytes:
        partition, offset = cause
        return b"%s:%d:%d" % (self.topics[side_of(partition)].encode(), source_partition(partition), offset)

    def letter_cause(self, letter: DeadLetter) -> bytes:
        return b"%s:%d:%d" % (letter.topic.encode(), letter.partition, letter.offset)


class ViewUnsupported(Exception):
    """The native core of the grouped view over a join met a value it does not hold."""


class JoinShardProcessor(ShardProcessor):
    """One shard of a join pipeline (see the module's docstring)."""

    core_reads = True  # both native cores read a clean batch of changelogs themselves (`_read_natively`)
    join_core: str | None = None  # `python` after the native join core refused a value (until the next start)
    view_core: str | None = None  # `python` after the view's native core refused one

    def _parts(self, keys: KeyCheck | None) -> tuple[Any, None, Renderer]:
        """Both sources' reader (tables read there, by side) and the join's renderer."""
        return self._make_reader(), None, JoinRenderer(self.pipeline)

    def _make_reader(self) -> Any:
        """Both sources' units (stage 2 of a join through the exchange reads its own)."""
        return JoinUnitReader(self.pipeline, self.pipeline.strict, join_co_partitioned(self.pipeline))

    def _new_reducer(self) -> Any:
        # (a table side's units are made as the batch joins: the Python join, which never
        # asks to join a batch again)
        tables = joins_a_table(self.pipeline)
        return JoinReducers(self.pipeline, self.join_core or ("python" if tables else None), self.view_core)

    def restore(self) -> None:
        self.join_core = self.view_core = None  # (a new start tries the native cores again)
        super().restore()

    def _readable(self) -> bool:
        """Not co-partitioned (the core checks no side's message keys), both sides changelogs the core reads."""
        return not join_co_partitioned(self.pipeline) and all(reads_natively(side) for side in side_pipelines(self.pipeline))

    def _read_natively(self, fresh: Sequence[InputRecord], out: Outgoing) -> dict[int, PendingRecord] | None:
        """The view's native core reads the batch (`read_join`), the join's joins it into the
        view's (`join_kept`), which reduces and renders it: as `_join_and_view_natively`,
        without a Python object per event. None (nothing done) when a core is Python, the
        batch is not clean, or a core refuses a value (that core is then Python's)."""
        parts, pending = partitions(fresh, self.checkpoint.pending)
        read = self._read_join(parts)
        if read is not None and self._over_cache({("j", key) for key in read[0]} - self.held):
            self._forget_reducer()  # (as `ShardProcessor._read_natively`: the new cores read it again)
            read = self._read_join(parts)
        if read is None:
            return None
        reducer = self.reducer
        records = [record for _, rows in parts for record in rows]
        letters = len(out.dlq)
        self._load({("j", key) for key in read[0]}, forget=False)
        if self.reducer is not reducer:  # (the join's core refused a stored value: `_join_in_python`)
            return None
        self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
        core = reducer.grouped_core
        try:
            for indices, index, reason, detail in core.join_kept(reducer.join):
                unit = [(None, records[i]) for i in indices]
                self.reader.letters[side_of(unit[0][1].partition)].rejected(out, unit, Rejected(reason, index, detail))
        except Unsupported as exc:
            del out.dlq[letters:]
            self._join_in_python(exc)
            return None
        try:
            self._load({("v", key) for key in core.touched_read()}, forget=False)
            refused, out.view, out.delta, out.state = core.apply_read()
        except Unsupported as exc:
            del out.dlq[letters:]
            self._view_in_python(exc)
            return None
        for indices, _index, reason, *_shown in refused:
            refuse_joined_row(self.reader.letters, out, records[indices[0]], Reason(reason))
        out.state = reducer.join.take_state_changes() + out.state
        pending.update((records[i].partition, held_over(records[i])) for i in read[1])
        return pending

    def _read_join(self, parts: list[tuple[int, list[InputRecord]]]) -> tuple[list[bytes], list[int]] | None:
        """`GroupedCore.read_join` of the batch: its join keys' state prefixes and held `-C`s."""
        reducer = self.reducer
        if reducer.grouped_core is None or isinstance(reducer.join, JoinReducer):
            return None
        return reducer.grouped_core.read_join(reducer.join, parts, RIGHT_PARTITIONS)

    def _join_in_python(self, exc: Unsupported) -> None:
        """The native join core refused a value: the reducer (and what it holds) goes, and a
        `JoinReducer` joins from here until the next start, loading from the store."""
        log.warning("%s shard %d joins in Python from here: the native join core %s",
                    self.pipeline.pipeline, self.shard, exc)
        self.join_core = "python"
        self._forget_reducer()

    def _view_in_python(self, exc: Exception) -> None:
        """The view's native core refused a value: as `_join_in_python`, for the grouped view."""
        log.warning("%s shard %d reduces the view over the join in Python from here: the native core %s",
                    self.pipeline.pipeline, self.shard, exc)
        self.view_core = "python"
        self._forget_reducer()

    def _new_core(self) -> Any:
        return None

    @property
    def cores(self) -> str:
        join = getattr(self.reducer, "join", None)
        said = "Python join" if join is None or isinstance(join, JoinReducer) else "native join core"
        if getattr(self.reducer, "has_view", False):
            said += ", native view core" if self.reducer.grouped_core is not None else ", Python view"
        return said

    def _consumed(self, offsets: Mapping[int, int]) -> dict[str, dict[int, int]]:
        """The consumed offsets of both topics, for the transaction."""
        topics = self.renderer.topics
        consumed: dict[str, dict[int, int]] = {topic: {} for topic in topics}
        for partition, offset in offsets.items():
            consumed[topics[side_of(partition)]][source_partition(partition)] = offset
        return {topic: by_partition for topic, by_partition in consumed.items() if by_partition}

    def _touched(self, units: Sequence[Unit]) -> set[Any]:
        try:
            return self._join_keys(units)
        except Unsupported as exc:
            self._join_in_python(exc)
            return self._join_keys(units)

    def _join_keys(self, units: Sequence[Unit]) -> set[Any]:
        join = self.reducer.join
        if any(self.reader.tables):
            units = self._table_rows(units)
        keys = {join.state_key(side_of(record.partition), event) for unit in units for event, record in unit}
        keys.discard(None)
        return {("j", state_prefix(key)) for key in keys}

    def _table_rows(self, units: Sequence[Unit]) -> list[Unit]:
        """The units with each table record's rows (new, `before`, its key's last row,
        loaded from the store) as events, for the join keys they touch."""
        assert self.store is not None
        items = [(unit, item) for unit in units if (item := self.reader.item_of(unit)) is not None]
        self.last_rows.load(self.store, {item.key for _, item in items if item.key is not None},
                            self.pipeline.spark.state_cache_keys)
        rows: list[Unit] = [unit for unit in units if self.reader.item_of(unit) is None]
        for unit, item in items:
            last = self.last_rows.rows.get(item.key) if item.key is not None else None
            record = unit[0][1]
            rows += [((SourceEvent(Op.APPEND, row, item.tag), record),)
                     for row in (item.row, item.before, last) if row is not None]
        return rows

    def _load(self, touched: set[Any], *, forget: bool = True) -> None:
        """Load the join keys (`("j", state_prefix(key))`) and view keys (`("v", key)`) not held yet."""
        assert self.store is not None
        wanted = touched - self.held
        if not wanted:
            return
        if forget and self._over_cache(wanted):
            self._forget_reducer()
            wanted = touched
        joins = [prefix for kind, prefix in wanted if kind == "j"]
        if joins:
            try:
                self.reducer.join.restore(self.store.load_keys(joins))
            except Unsupported as exc:  # (a stored value the native core does not hold)
                self._join_in_python(exc)
                self._load(touched, forget=forget)
                return
        views = [key for kind, key in wanted if kind == "v"]
        if views and (core := self.reducer.grouped_core) is not None:  # (key JSON; `_view_natively` loads them)
            core.restore(self.store.load_keys(views))
        elif views:
            self.reducer.grouped.restore(self.store.load_keys(key_bytes(key) for key in views))
        self.held |= wanted

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[tuple[list[ViewChange], int]]:
        """Join each unit; then, for a grouped view over the join, reduce the joined records.
        When the native join core refuses a value, the dead letters the join added go and
        Python joins the batch again from the store (`_join_in_python`)."""
        letters = len(out.dlq)
        try:
            return self._join_units(units, out)
        except (Unsupported, ViewUnsupported) as exc:
            del out.dlq[letters:]
            if isinstance(exc, ViewUnsupported):
                self._view_in_python(exc)
            else:
                self._join_in_python(exc)
            self._load(self._touched(units))
            return self._reduce(units, out)  # (each core falls back once: this recurses twice at most)

    def _join_units(self, units: Sequence[Unit], out: Outgoing) -> list[tuple[list[ViewChange], int]]:
        # (a join with a table side joins in Python: `_new_reducer`)
        if self.reducer.grouped_core is not None and not isinstance(self.reducer.join, JoinReducer):
            self._join_and_view_natively(units, out)
            return []
        join, grouped = self.reducer.join, self.reducer.grouped
        joined: list[tuple[Unit, JoinChanges]] = []
        for unit in units:
            side = side_of(unit[0][1].partition)
            item = self.reader.item_of(unit) if self.reader.tables[side] is not None else None
            try:
                events = [event for event, _ in unit] if item is None else self.last_rows.unit(item)
                made = join.apply(side, events) if events else []
            except Rejected as rejected:
                if item is None:
                    self.reader.letters[side].rejected(out, unit, rejected)
                else:
                    self.reader.letters[side].add(out, item.record, rejected.reason, rejected.detail)
                continue
            if item is not None:
                self.last_rows.put(item)
            changes = JoinChanges(made)
            changes.cause = cause_of(unit[0][0].tag)
            joined.append((unit, changes))
        if not self.reducer.has_view:
            return [(changes, unit[0][0].tag[0]) for unit, changes in joined if changes]
        inputs = [(unit, as_units(changes, unit[0][0].tag)) for unit, changes in joined]
        if self.reducer.grouped_core is not None:
            self._view_natively(inputs, out)
            return []
        touched = {("v", grouped.state_key(event)) for _, made in inputs for sub in made for event in sub}
        touched.discard(("v", None))
        self._load(touched, forget=False)
        out_changes: list[tuple[list[ViewChange], int]] = []
        for unit, made in inputs:
            for sub in made:
                try:
                    out_changes.append((grouped.apply(sub), unit[0][0].tag[0]))
                except Rejected as rejected:
                    refuse_joined_row(self.reader.letters, out, unit[0][1], rejected.reason)
        return out_changes

    def _join_and_view_natively(self, units: Sequence[Unit], out: Outgoing) -> None:
        """Both native cores over the batch, the joined records never Python objects
        (`GroupedCore.join_read`): the join's refusals and the view's are dead letters of
        their source records, as in `_join_units` and `_view_natively`."""
        core = self.reducer.grouped_core
        refused = core.join_read(self.reducer.join, [(side_of(unit[0][1].partition), unit) for unit in units])
        for unit_index, index, reason, detail in refused:
            unit = units[unit_index]
            self.reader.letters[side_of(unit[0][1].partition)].rejected(out, unit, Rejected(reason, index, detail))
        try:
            self._load({("v", key) for key in core.touched_read()}, forget=False)
            view_refused, out.view, out.delta, out.state = core.apply_read()
        except Unsupported as exc:
            raise ViewUnsupported(str(exc)) from exc
        for records, _index, reason, *_shown in view_refused:
            refuse_joined_row(self.reader.letters, out, units[records[0]][0][1], Reason(reason))

    def _view_natively(self, inputs: Sequence[tuple[Unit, list[list[SourceEvent]]]], out: Outgoing) -> None:
        """The grouped view over the joined units on its native core: their view, delta and
        state records into `out` (`_render` adds the join's state); a refused one is a dead
        letter of its source record, as in Python."""
        core = self.reducer.grouped_core
        units = [[(event, None) for event in sub] for _, made in inputs for sub in made]  # (item[0]: the event)
        sources = [unit for unit, made in inputs for _ in made]
        try:
            self._load({("v", key) for key in core.touched(units)}, forget=False)
            refused, out.view, out.delta, out.state = core.apply_batch(units)
        except Unsupported as exc:
            raise ViewUnsupported(str(exc)) from exc
        for unit_index, _index, reason, *_shown in refused:
            refuse_joined_row(self.reader.letters, out, sources[unit_index][0][1], Reason(reason))

    def _render(self, changes: Sequence[tuple[list[ViewChange], int]], out: Outgoing) -> None:
        if self.reducer.grouped_core is None:
            super()._render(changes, out)
        else:  # (the view's native core made its view, delta and state records: `_view_natively`)
            out.state = self.reducer.join.take_state_changes() + out.state + self.last_rows.take_state_changes()


class JoinChanges(list[ViewChange]):
    """A unit's join records with its cause (what they retract is not kept: no `retracts`)."""

    __slots__ = ("cause",)
    cause: Cause


def as_units(changes: Iterable[ViewChange], tag: tuple[int, int, int]) -> list[list[SourceEvent]]:
    """A source unit's join records as the grouped view's units (a `-C` with its `+C`),
    each tagged with the source unit's tag."""
    units: list[list[SourceEvent]] = []
    for change in changes:
        event = SourceEvent(change.op, change.row, tag)
        if change.op is Op.CORRECT_TO and units:
            units[-1].append(event)
        else:
            units.append([event])
    return units


__all__ = ["JoinReducers", "JoinShardProcessor", "JoinUnitReader", "as_units", "side_of", "source_partition"]
