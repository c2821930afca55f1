"""A re-grouping view in shards (`shards: M`): stage 1 routes, the driver closes,
stage 2 reduces, each stage's shard in its own Kafka transaction.

A view whose key lacks some message-key column (totals per team over a topic keyed
by player) sees each view key's events in every source partition. With `shards: M`
it runs in two stages joined by the topic `P.repartition` (M partitions), as Kafka
Streams re-keys through a repartition topic:

1. **Stage 1, one shard per source partition p** (`RouteProcessor`, writer
   `<writer>`, transactional id `P-<writer>-<p>`): decode, pair, check the message
   keys, apply `view.where`, and check each unit as the view would (its view key, its
   summed columns) and against the live rows of its message key, kept per message key
   in `P.rows` partition p (and the shard's local store). A refused unit is
   dead-lettered here, once, whole. Each accepted unit goes to `P.repartition`
   partition `shard_of(view key)`: one record per shard it touches, holding its events
   there with their tags and the tag of the unit's first event. One transaction:
   those records, the dead letters, the `P.rows` changes, the checkpoint, the offsets.
2. **The driver closes the batch** (`Closer`): once every stage-1 task of a Spark
   batch has committed, it writes one close record to every `P.repartition` partition
   in a transaction of its own (`P-<writer>-close`).
3. **Stage 2, one shard per `P.repartition` partition m** (`ApplyProcessor`, writer
   `<writer>.view`): reads its partition from its checkpoint through the close record
   the driver just wrote (`read_closed`). Between two close records lies one stage-1
   batch (or the part of one that an engine stop left, with the next run's first):
   each such segment is merged as the one-shard view merges a batch (each source
   partition in offset order, the partitions by the tag of each unit's first event)
   and the segments are applied in order, by the view's own reducer or native core,
   committing the view, deltas, `P.state` partition m and its checkpoint.

What a segment holds is fixed once committed, so a replayed stage-2 batch gives each
shard the same units in the same order; stage 1's replay writes nothing (its
checkpoint covers the range), as every shard's does. Per view key the order is
(stage-1 batch, tag), the one-shard merge's order, and stage 1's check per message
key refuses exactly what the view would: equal rows have equal message-key columns,
so a row's live copies in its view key are its live copies in its message key. A
correction that moves a row between view keys in two shards commits in two
transactions: per key nothing changes, across keys a reader can see one before the
other (docs/SEMANTICS.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import heapq
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import orjson
from confluent_kafka import KafkaException, TopicPartition

from refold import environment
from refold.config import ColumnSpec, Pipeline, ViewSpec
from refold.connectors.runtime import Executor, Materializations
from refold.errors import OperationalError
from refold.kafka.io import admin_client, read_to_end
from refold.kafka.transactions import TransactionalWriter, TransactionFailed
from refold.model.changelog import Op
from refold.model.reasons import Reason
from refold.plan import (
    close_id,
    message_key,
    ranked_globally,
    regroup_topic,
    stage2_shards,
    tops_topic,
    view_pipeline,
)
from refold.recovery.records import PendingRecord
from refold.reduce import Rejected, SourceEvent, make_reducer
from refold.reduce.grouped import GroupedReducer
from refold.reduce.values import key_bytes
from refold.reduce.where import filter_units
from refold.runtime.batch import InputRecord, Outgoing, Unit, Units
from refold.runtime.native import NativeRead, Unsupported, refold_native
from refold.runtime.render import UnitChanges
from refold.runtime.shard import ShardProcessor
from refold.runtime.tops import CLOSE_FIRST, LocalTops, local_top_record

log = logging.getLogger(__name__)

__all__ = ["ApplyProcessor", "Closer", "ExchangeReader", "RouteProcessor", "RouteValidator", "Trimmer",
           "close_value", "merge_keys", "read_closed", "shard_of", "view_pipeline"]


def shard_of(key_json: bytes, shards: int) -> int:
    """The stage-2 shard of a view key (its `key_bytes`): stable across runs and machines."""
    return int.from_bytes(hashlib.blake2b(key_json, digest_size=8).digest(), "big") % shards


def close_value(run: int, seq: int) -> bytes:
    """The close record of one engine run's `seq`-th close."""
    return orjson.dumps({"close": [run, seq]})


# Stage 1 ------------------------------------------------------------------------------


class RouteValidator:
    """Stage 1's reducer: checks each unit as the view would and against its message
    key's live rows (a grouped reducer keyed by the message key, counting rows), and
    returns the unit's routed records (P.repartition partition, value)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.shards = stage2_shards(pipeline)
        assert self.shards
        self.checks: Any = make_reducer(pipeline.view)  # only its `view_key`: the view's checks
        spec = ViewSpec(key=list(message_key(pipeline)), columns={"rows": ColumnSpec(agg="count", column="*")})
        self.rows = GroupedReducer(spec)
        self.merge_keys: dict[int, list[Any]] = {}  # the batch's: input offset -> its unit's merge key
        self._shards: dict[tuple[Any, ...], int] = {}  # view key -> its shard, as met
        self.by_row = ranked_globally(pipeline)  # a global Top-N's rows go by message key (refold.runtime.tops)

    def apply(self, unit: Sequence[SourceEvent]) -> list[tuple[int, bytes]]:
        """The unit's routed records; Rejected (nothing changes) as the view would refuse it."""
        keys = self.view_keys(unit)
        self.rows.apply(unit)  # a retraction of a row its message key does not hold: Rejected
        return self.routed(unit, keys)

    def view_keys(self, unit: Sequence[SourceEvent]) -> list[tuple[Any, ...]]:
        """The view key of each event of the unit; Rejected as the view would refuse the unit."""
        view_key = self.checks.view_key
        keys = [view_key(event, index) for index, event in enumerate(unit)]
        if self.by_row:
            row_key = self.rows.view_key
            return [row_key(event, index) for index, event in enumerate(unit)]
        return keys

    def routed(self, unit: Sequence[SourceEvent], keys: Sequence[tuple[Any, ...]]) -> list[tuple[int, bytes]]:
        """An accepted unit's records: (P.repartition partition, value) for each shard it touches."""
        by_shard: dict[int, list[list[Any]]] = {}
        shards = self._shards
        for event, key in zip(unit, keys, strict=True):
            shard = shards.get(key)
            if shard is None:
                shard = shard_of(key_bytes(key), self.shards)
                if all(type(value) is str for value in key):  # (1 == 1.0 == True: those are not kept)
                    if len(shards) >= 100_000:
                        shards.clear()
                    shards[key] = shard
            by_shard.setdefault(shard, []).append([event.tag[0], event.tag[1], event.tag[2], int(event.op), event.row])
        merge_key = self.merge_keys[unit[0].tag[2]]
        if self.by_row:  # with the unit's id: stage 3 puts its halves together again
            return [(shard, orjson.dumps([merge_key, events, unit[0].tag[2]])) for shard, events in by_shard.items()]
        return [(shard, orjson.dumps([merge_key, events])) for shard, events in by_shard.items()]

    def take_deltas(self) -> list[dict[str, Any]]:
        return []

    def take_state_changes(self) -> list[tuple[bytes, bytes | None]]:
        self.rows.take_deltas()  # (the row counts' deltas: not an output)
        return self.rows.take_state_changes()

    def state_key(self, event: SourceEvent) -> tuple[Any, ...] | None:
        return self.rows.state_key(event)

    def restore(self, records: Any) -> None:
        self.rows.restore(records)

    def view(self) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {}


class RouteProcessor(ShardProcessor):
    """Stage 1's shard of source partition p (see the module's docstring): the view
    shard's batch, transaction and recovery, with `RouteValidator` as its reducer,
    `P.rows` as its state topic and routed units as its output."""

    core: Any

    def _state_topic(self) -> str:
        return self.pipeline.rows_topic

    def _new_reducer(self) -> Any:
        return RouteValidator(self.pipeline)

    def _new_core(self) -> Any:
        """The native core for the message keys' live rows (a count per message key), as
        `spark.core` allows. For a grouped view it also takes the view's checks and the
        routing of a batch it reads itself (`_apply_read`); otherwise, and for a Top-N,
        the view's checks stay in Python (`_reduce_natively`)."""
        if self.pipeline.spark.core == "python" or refold_native is None:
            return None
        core = refold_native.GroupedCore(list(message_key(self.pipeline)), [("rows", "count", "*")], None, False)
        view = self.pipeline.view
        if view.top_n is None:  # a grouped view's checks and routing in the core too, after its reader
            core.route_with(list(view.key), [(name, spec.agg, spec.column) for name, spec in view.columns.items()],
                            stage2_shards(self.pipeline))
        else:
            self.core_reads = False
        return core

    def _apply_read(self, out: Outgoing) -> list[Any]:
        """Stage 1 of the units the core read (`route_read`): the view's checks, the
        message keys' live rows, the accepted units routed into `out.exchange`."""
        refused, routed, out.state = self.core.route_read()
        out.route(routed)
        return refused

    def _reduce_natively(self, units: Sequence[Unit], out: Outgoing) -> bool:
        """The view's checks (Python), then the message keys' live rows in the native
        core; the accepted units routed. False, with nothing of the batch kept, when the
        core cannot take it: the shard goes on in Python (`ShardProcessor._reduce_natively`)."""
        assert self.core is not None
        validator: RouteValidator = self.reducer
        validator.merge_keys = merge_keys(units)
        letters = len(out.dlq)
        checked: list[tuple[Unit, list[tuple[Any, ...]]]] = []
        for unit in filter_units(self.row_filter, units, functools.partial(self.dead_letters.refuse, out)):
            try:
                checked.append((unit, validator.view_keys([event for event, _ in unit])))
            except Rejected as rejected:
                self.dead_letters.refuse(out, unit, rejected.index, rejected.reason)
        kept = [unit for unit, _keys in checked]
        try:
            self._load(self._touched(kept))
            self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
            refused, _view, _delta, state = self.core.apply_batch(kept)
        except Unsupported as exc:
            return self._fall_back(out, letters, exc)
        refused_units = set()
        for unit_index, index, reason, _detail in refused:
            self.dead_letters.refuse(out, kept[unit_index], index, Reason(reason))
            refused_units.add(unit_index)
        for unit_index, (unit, keys) in enumerate(checked):
            if unit_index not in refused_units:
                out.route(validator.routed([event for event, _ in unit], keys))
        out.state = state
        return True

    def _new_materializations(self, executor: Executor | None) -> Materializations | None:
        return None  # stage 2 materializes

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        self.reducer.merge_keys = merge_keys(units)
        return super()._reduce(units, out)

    def _render(self, changes: Sequence[UnitChanges], out: Outgoing) -> None:
        for routed, _event_time in changes:
            out.route(routed)
        out.state = self.reducer.take_state_changes()


def merge_keys(units: Sequence[Unit]) -> dict[int, list[Any]]:
    """Each input offset's merge key in a partition's units of a batch (in order): the
    greatest first tag of the units up to its own. The one-shard merge takes, again and
    again, the partition whose next unit has the least first tag; that order is exactly
    the order of these keys (each partition's keys only grow), so stage 2 gets the same
    order from any subset of the units: those of its shard, those of a unit that was not
    refused."""
    keys: dict[int, list[Any]] = {}
    greatest: Any = None
    for unit in units:
        first = unit[0][0].tag
        if greatest is None or first > greatest:
            greatest = first
        for _event, record in unit:
            keys[record.offset] = list(greatest)
    return keys


# The driver's close ---------------------------------------------------------------------


CLOSE_ATTEMPTS = 3  # tries of one batch's close before the run fails


class Closer:
    """The driver's close records (`P-<writer>-close`): one to every `P.repartition`
    partition per Spark batch, after every stage-1 task of the batch committed."""

    def __init__(self, pipeline: Pipeline, settings: Mapping[str, Any]) -> None:
        assert stage2_shards(pipeline)
        self.pipeline = pipeline
        self.writer = TransactionalWriter(
            dict(settings), close_id(pipeline), timeout_ms=environment.transaction_timeout_ms(),
            label=f"pipeline {pipeline.pipeline!r} (close)",
        )
        self.writer.initialise()  # fences an older run's driver
        self.closed = 0

    def close(self, run: int, tops: bool = False, regroup: bool = False) -> bytes:
        """Close the batch: the close record, committed to every `P.repartition`
        partition (`tops`: to `P.tops`; `regroup`: to every `P.regroup` partition, a
        regrouping join's; both after every stage-2 shard committed)."""
        self.closed += 1
        value = close_value(run, self.closed)
        writer = self.writer
        topic = regroup_topic(self.pipeline) if regroup else self.pipeline.repartition_topic
        for attempt in range(1, CLOSE_ATTEMPTS + 1):
            try:
                writer.begin()
                if tops:
                    writer.send(tops_topic(self.pipeline), None, value, partition=0)
                for shard in range(0 if tops else stage2_shards(self.pipeline)):
                    writer.send(topic, None, value, partition=shard)
                writer.commit()
                return value
            except TransactionFailed as exc:
                # A broker's loss can fail the close (a lost leader, a fatal sequence error
                # after a rolling restart). Writing it again is harmless even when the failed
                # commit landed after all: a close record only ends a segment, and an empty
                # segment merges to nothing.
                if attempt == CLOSE_ATTEMPTS:
                    raise
                log.warning("pipeline %r: closing the batch failed (attempt %d): %s; re-initialising",
                            self.pipeline.pipeline, attempt, exc)
                writer.initialise()
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        self.writer.close()


class Trimmer:
    """Deletes `P.repartition`'s (and a later stage's input topic's) records before each
    shard's committed offset: the next stage never reads them again (Kafka Streams
    purges its repartition topics so). Off the batch's path and best effort: `trim`
    sends the request and returns; a refusal (no DELETE right) or a timeout (a lost
    leader) is logged when it comes, and while a topic's last request is unanswered its
    next one is skipped (a later batch's offsets cover it). The broker's retention
    stays the bound."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = settings
        self.admin: Any = None
        self.pending: dict[str, list[Future[Any]]] = {}

    def trim(self, topic: str, offsets: Mapping[int, int]) -> None:
        if not offsets or any(not future.done() for future in self.pending.get(topic, ())):
            return
        if self.admin is None:
            self.admin = admin_client(self.settings)
        wanted = [TopicPartition(topic, shard, offset) for shard, offset in offsets.items()]
        futures = self.admin.delete_records(wanted, request_timeout=30)
        for partition, future in futures.items():
            future.add_done_callback(functools.partial(_trimmed, partition))
        self.pending[topic] = list(futures.values())

    def wait(self, timeout: float = 5.0) -> None:
        """At the run's end: the requests sent, answered or `timeout` seconds gone; the
        client let go."""
        futures = [future for pending in self.pending.values() for future in pending]
        concurrent.futures.wait(futures, timeout=timeout)
        self.admin, self.pending = None, {}


def _trimmed(partition: TopicPartition, future: Future[Any]) -> None:
    try:
        future.result()
    except KafkaException as exc:
        log.warning("%s partition %d: deleting the records the next stage read failed: %s", partition.topic,
                    partition.partition, exc.args[0].str())


# Stage 2 --------------------------------------------------------------------------------


def read_closed(settings: Mapping[str, Any], pipeline: Pipeline, shard: int, start: int,
                close: bytes, timeout: float = 120.0, topic: str | None = None) -> list[InputRecord]:
    """Stage 2's input: `P.repartition` (or `topic`: stage 3's `P.tops`) partition `shard`
    from `start` through the close record `close` (read_committed). OperationalError when
    that record is not there: the driver wrote it before the stage began."""
    topic = topic or pipeline.repartition_topic
    records: list[InputRecord] = []
    deadline = time.monotonic() + timeout
    position = start
    while True:
        # a commit returns before its markers are written: the last stable offset may
        # still stand before the close for a moment
        for msg in read_to_end(settings, topic, start={shard: position}, only=(shard,)):
            value = msg.value()
            records.append(InputRecord(shard, msg.offset(), msg.key(), value, msg.timestamp()[1]))
            position = msg.offset() + 1
            if value == close:
                return records
        if time.monotonic() > deadline:
            raise OperationalError(f"{topic} partition {shard}: the batch's close record is not in it from offset "
                                   f"{start} after {timeout:.0f}s ({len(records)} records read; an open transaction?)")
        time.sleep(0.02)


class ExchangeReader:
    """Stage 2's units from its `P.repartition` records (the `UnitReader` it replaces):
    segment by segment, each merged by tag (see the module's docstring). `meta`: each
    routed record's (close, merge key, unit id), by offset, for a global Top-N's stage 2."""

    def __init__(self) -> None:
        self.meta: dict[int, tuple[Any, list[Any], int | None]] = {}

    def read(self, fresh: Sequence[InputRecord], pending: Mapping[int, PendingRecord], out: Outgoing) -> Units:
        units: list[Unit] = []
        segment: dict[int, list[tuple[list[Any], Unit]]] = {}
        self.meta = {}
        opened: list[tuple[int, list[Any], int | None]] = []  # the segment's records, until its close
        for record in sorted(fresh, key=lambda r: r.offset):
            value = record.value or b""
            if value[:1] == CLOSE_FIRST:
                units.extend(_merged(segment))
                segment = {}
                close = orjson.loads(value)["close"]
                self.meta.update((offset, (close, key, unit_id)) for offset, key, unit_id in opened)
                opened = []
                continue
            merge_key, events, *unit_id = orjson.loads(value)
            unit = tuple((SourceEvent(Op(op), row, (t, p, o)), record) for t, p, o, op, row in events)
            segment.setdefault(merge_key[1], []).append((merge_key, unit))
            opened.append((record.offset, merge_key, unit_id[0] if unit_id else None))
        units.extend(_merged(segment))
        return Units(units, {}, 0)


def _merged(segment: Mapping[int, list[tuple[list[Any], Unit]]]) -> list[Unit]:
    """One segment's units: each source partition's in the order stage 1 committed them
    (its offset order), the partitions merged by the units' merge keys (`merge_keys`)."""
    streams = [segment[p] for p in sorted(segment)]
    return [unit for _key, unit in heapq.merge(*streams, key=lambda item: tuple(item[0]))]


class ApplyProcessor(ShardProcessor):
    """Stage 2's shard m (see the module's docstring): the view's shard over
    `P.repartition` partition m, made with `view_pipeline(pipeline)`. Its units were
    checked and filtered by stage 1. The native core (a grouped view's, or a Top-N's per
    `partition_by`) reads its routed records itself (`read_routed`, native/src/core/routed.rs)
    when they are all what stage 1 and the driver write; otherwise `ExchangeReader` does."""

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int = 0, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(view_pipeline(pipeline), settings, shard, *args, **kwargs)
        self.reader = ExchangeReader()
        self.row_filter = None
        # its records are routed units, JSON whatever the source's format
        self.core_reads = self.core is not None and hasattr(self.core, "read_routed")

    def _core_read(self, fresh: Sequence[InputRecord]) -> NativeRead | None:
        """`ExchangeReader.read` in the native core: its units wait there for `_apply_read`."""
        records = sorted(fresh, key=lambda r: r.offset)
        touched = self.core.read_routed(records)
        return None if touched is None else NativeRead(records, set(touched), {})

    # A global Top-N's stage 2 (refold.runtime.tops): its rows ranked, its local-top changes to P.tops
    def _new_reducer(self) -> Any:
        return LocalTops(self.pipeline.view) if ranked_globally(self.pipeline) else super()._new_reducer()

    def _new_materializations(self, executor: Executor | None) -> Materializations | None:
        return None if ranked_globally(self.pipeline) else super()._new_materializations(executor)

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        if not isinstance(self.reducer, LocalTops):
            return super()._reduce(units, out)
        out.exchange_topic = tops_topic(self.pipeline)
        tops = out.exchange.setdefault(0, [])
        for unit in units:
            try:
                moved = self.reducer.apply([event for event, _ in unit])
            except Rejected as rejected:  # (stage 1 checked it: not expected)
                self.dead_letters.refuse(out, unit, rejected.index, rejected.reason)
                continue
            if moved:
                close, merge_key, unit_id = self.reader.meta[unit[0][1].offset]
                tops.append(local_top_record(close, merge_key, unit_id, moved))
        return []

    def _render(self, changes: Sequence[UnitChanges], out: Outgoing) -> None:
        if not isinstance(self.reducer, LocalTops):
            return super()._render(changes, out)
        out.state = self.reducer.take_state_changes()
        return None
