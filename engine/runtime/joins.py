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
one call (`GroupedCore.join_read`): the joined records never become Python objects. A
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

import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refold.config import Pipeline
from refold.errors import UserError
from refold.kafka.io import partitions_of
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.plan import RIGHT_PARTITIONS, join_co_partitioned
from refold.recovery.records import DeadLetter, PendingRecord
from refold.reduce import Rejected, SourceEvent, ViewChange
from refold.reduce.grouped import GroupedReducer
from refold.reduce.join import JoinReducer, state_prefix
from refold.reduce.types import Cause, cause_of
from refold.reduce.values import key_bytes
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing, Unit, UnitReader, Units
from refold.runtime.jointables import TableSide
from refold.runtime.native import Unsupported, join_reducer, join_view_core
from refold.runtime.render import Renderer
from refold.runtime.shard import ShardProcessor
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import TableItem, is_table, joins_a_table, side_pipelines

log = logging.getLogger(__name__)


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

    core_reads = False
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
        touched = {("j", join.state_key(side_of(record.partition), event)) for unit in units for event, record in unit}
        touched.discard(("j", None))
        return touched

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
        """Load the join keys (`("j", key)`) and view keys (`("v", key)`) not held yet."""
        assert self.store is not None
        wanted = touched - self.held
        if not wanted:
            return
        if forget and self._over_cache(wanted):
            self._forget_reducer()
            wanted = touched
        joins = [state_prefix(key) for kind, key in wanted if kind == "j"]
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
                    side = side_of(unit[0][1].partition)
                    self.reader.letters[side].add(out, unit[0][1], rejected.reason,
                                                  "a joined row the view over the join refuses")
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
            record = units[records[0]][0][1]
            self.reader.letters[side_of(record.partition)].add(out, record, Reason(reason),
                                                               "a joined row the view over the join refuses")

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
            record = sources[unit_index][0][1]
            self.reader.letters[side_of(record.partition)].add(out, record, Reason(reason),
                                                               "a joined row the view over the join refuses")

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
