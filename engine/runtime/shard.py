"""One shard's part of a micro-batch, exactly once: decode, pair, merge, reduce, commit in one transaction.

A `ShardProcessor` owns one shard of a view: its transactional writer `P-<writer>-<shard>`,
local store (`refold.state`), reducer, checkpoint and materialization sessions. Spark is not
needed: a Spark task (`refold.spark.tasks`) or `BatchProcessor` hands it each batch's records.

Start (`_start`): lock the store (a second attempt waits for the first), initialise the writer
(fencing older attempts), read the checkpoint and bring the store to it (`refold.state.bring_to`).

The reducer holds the keys the shard's batches touched (up to `spark.state_cache_keys`),
loaded from the store before each batch. Every batch commits in one Kafka transaction of
the shard: view, deltas, dead letters, `P.state` (partition = shard), the checkpoint
(`P.checkpoints`, key `<writer>/<shard>`), the consumed offsets and the trace index (`P.trace`,
`refold.runtime.traceindex`); only then does the store take the same changes with the checkpoint's stamp, so it is never ahead of Kafka.
Records the last checkpoint covers are dropped first (a replay writes nothing); a failed transaction runs the batch again (three times at most); a fence stops the shard.

`suspend()` lets go of the store's lock between two Spark tasks; `resume()` takes it again and says whether the store still holds what this processor last committed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from refold import environment
from refold.config import Pipeline
from refold.connectors.runtime import Executor, Materializations
from refold.errors import OperationalError
from refold.kafka.io import consumer_config
from refold.kafka.transactions import TransactionalWriter, TransactionFailed
from refold.model.reasons import Reason
from refold.plan import checkpoint_key, shard_writer, view_partitioning
from refold.recovery.records import (
    Checkpoint,
    PendingRecord,
    dead_letter_headers,
    encode_checkpoint,
    encode_dead_letter,
    first_checkpoint,
)
from refold.recovery.restore import load_checkpoints
from refold.reduce import Rejected, make_reducer, whole_state
from refold.reduce.values import key_bytes
from refold.reduce.where import condition_of, filter_units
from refold.runtime.batch import BatchStats, DeadLetters, InputRecord, Outgoing, Unit, UnitReader
from refold.runtime.collector import collector_paused
from refold.runtime.hooks import NO_HOOKS, Hooks
from refold.runtime.native import (
    NativeRead,
    Unsupported,
    native_core,
    read_batch,
    reads_natively,
    refusal_shown,
)
from refold.runtime.render import CAUSE, Renderer, UnitChanges
from refold.runtime.shards import KeyCheck
from refold.runtime.tables import LastRows, TableReader, is_table, reduce_table_rows, touched_by
from refold.runtime.traceindex import IndexWriter
from refold.state import Recovery, ShardId, ShardStore, Stamp, bring_to

log = logging.getLogger(__name__)

ATTEMPTS = 3  # transactions per batch before the processor gives up
STORE_LOCK_SECONDS = 120.0  # how long a shard waits for another attempt's hold on its store


class ShardProcessor:
    """One shard's batches, one at a time (see the module's docstring).

    `hooks`: the chaos tests' crash and stall points (`refold.runtime.hooks`); `keys` checks the
    message keys of a co-partitioned view (shared by a run's shards); `checkpoint_partition`: where
    the shard's checkpoint records go; `state_root`: its store's (`spark.state_dir`, else `<Refold
    home>/state`); `run`: the engine run its checkpoints name; `start=False` leaves `lock()`, `fence()`
    then `restore()` to the caller (the `BatchProcessor` fences every shard before any restores).
    `fence`, `restore` and `_commit` are the seams the benchmarks replace; a join's shard
    (`refold.runtime.joins`) replaces the reader and renderer (`_parts`), the reducer and `_consumed`."""

    core_reads = True  # the native core may read the batch's records itself (`_core_read`)

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], shard: int = 0, executor: Executor | None = None,
                 *, hooks: Hooks = NO_HOOKS, keys: KeyCheck | None = None, checkpoint_partition: int = 0,
                 state_root: Path | None = None, run: int = 0, start: bool = True) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.shard = shard
        self.run = run  # the engine run whose batches this processor commits (Checkpoint.run)
        self.checkpoint_partition = checkpoint_partition
        self.topic = pipeline.source.topic
        self.hooks = hooks
        self.dead_letters = DeadLetters(self.topic, pipeline.pipeline, pipeline.strict)
        self.reader, self.tables, self.renderer = self._parts(keys)
        self.last_rows = LastRows()
        # the view's row filter (`view.where`), applied to each unit before the reducer
        self.row_filter = condition_of(pipeline.view.where) if pipeline.view.where is not None else None
        self.state_topic = self._state_topic()
        self.aborts = 0  # transactions that failed and were run again
        self.last = BatchStats()
        self.recovery: Recovery | None = None  # how the store last came to the checkpoint
        self.state_id = ShardId(pipeline.pipeline, pipeline.writer, shard)
        if state_root is None and pipeline.spark.state_dir:
            state_root = Path(pipeline.spark.state_dir)
        self.state_root = state_root
        self.store: ShardStore | None = None
        self.reducer = self._new_reducer()
        self.core: Any = self._new_core()  # the native core (refold.runtime.native) in the reducer's place
        self.core_reads = self.core_reads and self._readable()  # the core reads the records too
        self.held: set[Any] = set()  # the keys the reducer (key tuples) or the core (key JSON) holds as the store does
        self.held_all = False  # the reducer holds the whole store (a backfill needs the whole view)
        self.checkpoint = first_checkpoint(self.pipeline, self.shard)
        self._watermarks: Consumer | None = None
        self.writer = TransactionalWriter(settings, pipeline.transactional_id(shard), timeout_ms=environment.transaction_timeout_ms(),
                                          consumer_group=f"refold.{pipeline.pipeline}", label=f"pipeline {pipeline.pipeline!r} (shard {shard})")
        # outputs.materialize: Flow's protocol per batch, fenced and checkpointed per shard
        self.materializations = self._new_materializations(executor)
        self.index = IndexWriter(pipeline, settings, shard)  # P.trace: where its view records are
        if start:
            try:
                self._start()
            except BaseException:
                self.close()
                raise

    # What a kind of shard replaces (`refold.runtime.exchange`: the stages of a re-grouping view)
    def _parts(self, keys: KeyCheck | None) -> tuple[Any, TableReader | None, Renderer]:
        """Its reader, table reader (a table source's records become units as applied) and renderer."""
        table = TableReader(self.pipeline, self.dead_letters, keys) if is_table(self.pipeline) else None
        return UnitReader(self.pipeline, self.dead_letters, keys), table, Renderer(self.pipeline)

    def _state_topic(self) -> str:
        return self.pipeline.state_topic

    def _new_reducer(self) -> Any:
        return make_reducer(self.pipeline.view, self.pipeline.outputs.view.emit if self.pipeline.outputs.view else "per_event")

    def _readable(self) -> bool:  # whether the native core may read the source's records itself
        return reads_natively(self.pipeline)

    def _new_core(self) -> Any:  # (a new one each time the reducer starts empty)
        return native_core(self.pipeline)

    def _consumed(self, offsets: dict[int, int]) -> dict[str, dict[int, int]]:  # the transaction's consumed offsets
        return {self.topic: offsets}
    def _new_materializations(self, executor: Executor | None) -> Materializations | None:
        return Materializations.from_pipeline(self.pipeline, executor, shard_writer(self.pipeline, self.shard))

    def _render(self, changes: Sequence[UnitChanges], out: Outgoing) -> None:
        """The batch's view, delta and state records from its changes (the Python path)."""
        out.view = self.renderer.view(changes)
        out.delta_rows = self.reducer.take_deltas()
        out.delta = self.renderer.deltas(out.delta_rows)
        out.state = self.reducer.take_state_changes() + self.last_rows.take_state_changes()

    # Lifecycle -----------------------------------------------------------------------

    def _start(self) -> None:
        """Lock the store, fence older attempts, read the checkpoint, bring the store to it."""
        self.lock()
        self.fence()  # before reading: recovery reads read_committed to the end
        self.restore()

    def lock(self) -> None:
        """Open the shard's store, taking its lock (waits for another process that holds it)."""
        if self.store is None:
            self.store = ShardStore.open(self.state_id, self.state_root, lock_timeout=STORE_LOCK_SECONDS)

    def fence(self) -> None:
        """Initialise the writer: fences older instances of this shard and settles their
        open transaction."""
        self.writer.initialise()

    def restore(self) -> None:
        """Read the shard's committed checkpoint and bring the store to it (after every
        shard of the run is fenced: an open transaction of another shard would hold the
        read up); the reducer starts empty."""
        started = time.monotonic()
        self.lock()
        assert self.store is not None
        with collector_paused():
            found = load_checkpoints(self.pipeline, self.settings, only=(self.checkpoint_partition,)).get(self.shard)
            self.checkpoint = found or first_checkpoint(self.pipeline, self.shard)
            self.recovery = bring_to(
                self.settings, self.state_topic, self.store, self.checkpoint.batch,
                checkpoint_at=self.checkpoint.committed_at,
            )
            self.forget()
        if self.materializations is not None:
            self.materializations.open(self.checkpoint)
        log.info("recovered %s shard %d (%s): batch %d, offsets %s; state store %s (%s, %d records read, %.1fs)",
                 self.pipeline.pipeline, self.shard, self.cores,
                 self.checkpoint.batch, self.checkpoint.offsets, self.recovery.how, self.recovery.reason,
                 self.recovery.records_read, time.monotonic() - started)

    def forget(self) -> None:
        """An empty reducer (and no last rows of an upsert source): it loads what the next
        batches touch from the store."""
        self._forget_reducer()
        self.last_rows.forget()

    def _forget_reducer(self) -> None:
        self.reducer = self._new_reducer()
        if self.core is not None:
            self.core = self._new_core()
        self.held = set()
        self.held_all = False

    @property
    def cores(self) -> str:
        """What reduces the shard's batches now: `native core` or `Python core`."""
        return "native core" if self.core is not None else "Python core"

    @property
    def held_keys(self) -> int:
        """How many keys this processor holds in memory (view keys and last rows)."""
        return len(self.held) + len(self.last_rows)

    def suspend(self) -> None:
        """Let go of the store (and its lock) until `resume`; the reducer, the writer and
        the checkpoint stay."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def resume(self) -> bool:
        """Take the store again. True when it still holds exactly what this processor last
        committed (its stamp is this checkpoint's); False when another process ran the
        shard since (this processor is stale: close it and start a new one)."""
        self.lock()
        assert self.store is not None
        stamp = self.store.stamp
        return stamp is not None and (stamp.batch, stamp.checkpoint_at) == (
            self.checkpoint.batch, self.checkpoint.committed_at
        )

    def close(self) -> None:
        try:
            if self.materializations is not None:
                self.materializations.close()
            self.writer.close()
        finally:
            self.index.close()
            if self._watermarks is not None:
                self._watermarks.close()
                self._watermarks = None
            self.suspend()

    @property
    def offsets(self) -> dict[int, int]:
        """The committed input offsets: partition -> next offset to read."""
        return dict(self.checkpoint.offsets)

    # The batch -------------------------------------------------------------------------

    def process(self, records: Sequence[InputRecord]) -> BatchStats | None:
        """Reduce and commit the shard's records of one batch. Returns None when every
        record was already committed (nothing is committed then).

        Raises FencedError (another instance took over), OperationalError (the
        transaction failed `ATTEMPTS` times), RecordError (strict mode)."""
        with collector_paused():
            failure: TransactionFailed | None = None
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    return self._process_once(records)
                except TransactionFailed as exc:
                    failure = exc
                    self.aborts += 1
                    log.warning("batch transaction failed (attempt %d): %s; re-initialising from Kafka", attempt, exc)
                    self._start()
            raise OperationalError(f"the batch's transaction failed {ATTEMPTS} times; giving up: {failure}") from failure

    def _process_once(self, records: Sequence[InputRecord]) -> BatchStats | None:
        started = time.monotonic()
        committed = self.checkpoint.offsets
        fresh = [r for r in records if r.offset >= committed.get(r.partition, 0)]
        if not fresh:
            return None
        out = Outgoing()
        read_natively = self.tables is None and self.core_reads
        if read_natively and (held := self._read_natively(fresh, out)) is not None:
            pending, unchanged, native = held, 0, True
        elif self.tables is None:
            read = self.reader.read(fresh, self.checkpoint.pending, out)
            native = self.core is not None and self._reduce_natively(read.units, out)
            if not native:
                self._load(self._touched(read.units))
                self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
                changes = self._reduce(read.units, out)
            pending, unchanged = read.pending, read.tombstones
        else:
            items = self.tables.read(fresh, out)
            assert self.store is not None
            self._load(touched_by(items, self.last_rows, self.store, self.pipeline, self.reducer.state_key))
            self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
            changes, unchanged = reduce_table_rows(items, self.last_rows, self.reducer, self.row_filter, self.dead_letters, out)
            unchanged += self.tables.tombstones
            pending = {}
            native = False
        if not native:  # (the native core made the view, delta and state records itself)
            self._render(changes, out)
        out.dlq.sort(key=lambda letter: (letter.partition, letter.offset))  # input order
        stats = BatchStats(
            batch=self.checkpoint.batch + 1,
            records_in=len(fresh),
            records_out=len(out.view) + len(out.delta),
            dead_letters=len(out.dlq),
            skipped=len(records) - len(fresh),
            tombstones=unchanged,
            out_by_topic=out.by_topic(self.pipeline),
        )
        offsets = dict(committed)
        for record in fresh:
            offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
        checkpoint = replace(
            self.checkpoint,
            batch=stats.batch,
            offsets=offsets,
            pending=pending,
            records_in=self.checkpoint.records_in + stats.records_in,
            records_out=self.checkpoint.records_out + stats.records_out,
            dlq=self.checkpoint.dlq + stats.dead_letters,
            committed_at=int(time.time() * 1000),
            run=self.run,
        )
        if self.materializations is not None:  # Load, Flush, Store, StartCommit
            driver_checkpoints = self.materializations.commit_units(checkpoint, changes, out.delta_rows, self.reducer.view)
            checkpoint = replace(checkpoint, driver_checkpoints=driver_checkpoints)
        commit_started = time.monotonic()
        self._commit(out, checkpoint)
        stats.commit_seconds = time.monotonic() - commit_started
        self.hooks.crash_point("after_commit", checkpoint.batch)
        self._stamp(out.state, checkpoint)
        if self.materializations is not None:
            self.materializations.acknowledge(checkpoint.batch)
        self.checkpoint = checkpoint
        stats.seconds = time.monotonic() - started
        stats.committed_at = time.time()
        self.last = stats
        return stats

    def _touched(self, units: Sequence[Unit]) -> set[Any]:
        if self.core is not None:
            return set(self.core.touched(units))  # as key JSON
        touched = {self.reducer.state_key(event) for unit in units for event, _ in unit}
        touched.discard(None)
        return touched

    def _over_cache(self, wanted: set[Any]) -> bool:
        """Whether holding `wanted` (keys not held yet) too passes `spark.state_cache_keys`."""
        return len(self.held) + len(wanted) > self.pipeline.spark.state_cache_keys

    def _load(self, touched: set[Any], *, forget: bool = True) -> None:
        """Load the view keys the batch is about to touch and the reducer does not hold
        from the store (all of it when a materialization backfills from the whole view).
        Past `spark.state_cache_keys` held keys the reducer starts empty first, unless
        not `forget` (the native core holds a batch it read: `_read_natively` saw to it)."""
        assert self.store is not None
        if self.pipeline.view.window is not None or (self.materializations is not None and self.materializations.backfilling):
            if not self.held_all:  # (a windowed view's windows close by the watermark: it holds them all)
                if forget:  # (else the native core holds a batch it read, and nothing yet: held_all is not set)
                    self._forget_reducer()
                (self.reducer if self.core is None else self.core).restore(whole_state(self.store))
                self.held_all = True
            return
        if self.held_all:
            return
        wanted = touched - self.held
        if not wanted:
            return
        if forget and self._over_cache(wanted):
            self._forget_reducer()
            wanted = touched
        if self.core is not None:
            self.core.restore(self.store.load_keys(wanted))
        else:
            self.reducer.restore(self.store.load_keys(key_bytes(key) for key in wanted))
        self.held |= wanted

    def _stamp(self, state: Sequence[tuple[bytes, bytes | None]], checkpoint: Checkpoint) -> None:
        """After the commit: the state changes and the checkpoint's stamp into the store in one
        write batch; the stamp's offset is P.state's high watermark (past this batch's records)."""
        assert self.store is not None
        if self._watermarks is None:
            self._watermarks = Consumer(consumer_config(self.settings, **{"isolation.level": "read_uncommitted"}))
            self._watermarks.list_topics(self.state_topic, timeout=60)  # its leader, as `read_to_end`
        _low, high = self._watermarks.get_watermark_offsets(TopicPartition(self.state_topic, self.shard), timeout=60)
        self.store.apply(state, Stamp(checkpoint.batch, int(high), checkpoint.committed_at))

    def _reduce(self, units: Sequence[Unit], out: Outgoing) -> list[UnitChanges]:
        """Apply each unit; a refused one changes nothing and is dead-lettered, once per record."""
        changes: list[UnitChanges] = []
        for unit in filter_units(self.row_filter, units, functools.partial(self.dead_letters.refuse, out)):
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as rejected:
                self.dead_letters.rejected(out, unit, rejected)
        return changes

    def _reduce_natively(self, units: Sequence[Unit], out: Outgoing) -> bool:
        """`_reduce` and its records, all in the native core; False when it cannot (`_fall_back`)."""
        assert self.core is not None
        letters = len(out.dlq)
        units = filter_units(self.row_filter, units, functools.partial(self.dead_letters.refuse, out))
        try:
            self._load(self._touched(units))
            self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
            refused, view, delta, state = self.core.apply_batch(units)
        except Unsupported as exc:
            return self._fall_back(out, letters, exc)
        for unit_index, index, reason, *shown in refused:
            self._refused(out, units[unit_index], index, reason, shown)
        out.view, out.delta, out.state = view, delta, state
        return True

    def _refused(self, out: Outgoing, unit: Unit, index: int, reason: str, shown: Sequence[Any]) -> None:
        """A unit the native core refused (`index`: its refused event's), dead-lettered."""
        self.dead_letters.refuse(out, unit, index, Reason(reason), *refusal_shown(reason, shown))

    def _read_natively(self, fresh: Sequence[InputRecord], out: Outgoing) -> dict[int, PendingRecord] | None:
        """The native core reads, reduces and renders the batch (`read_batch`): the held
        `-C`s for the checkpoint; None when it does not take the batch."""
        if self.core is None:
            return None
        read = self._core_read(fresh)
        if read is not None and self.pipeline.view.window is None and self._over_cache(read.touched - self.held):
            # the core keeps what it read, and starting empty is a new core: empty
            # first, then the new core reads the batch again (once per cache's fill)
            self._forget_reducer()
            read = self._core_read(fresh)
        if read is None:
            return None
        try:
            self._load(read.touched, forget=False)
            self.hooks.crash_point("mid_batch", self.checkpoint.batch + 1)
            refused = self._apply_read(out)
        except Unsupported as exc:
            self._fall_back(out, len(out.dlq), exc)
            return None
        read.refuse(refused, self.dead_letters, out)
        return read.pending

    def _core_read(self, fresh: Sequence[InputRecord]) -> NativeRead | None:
        """The native core reads the batch (its units wait in it for `_apply_read`)."""
        return read_batch(self.core, self.reader, fresh, self.checkpoint.pending)

    def _apply_read(self, out: Outgoing) -> list[Any]:
        """The units the core read, applied: its records into `out`, the refused units back."""
        refused, out.view, out.delta, out.state = self.core.apply_read()
        return refused

    def _fall_back(self, out: Outgoing, letters: int, exc: Unsupported) -> bool:
        """The native core cannot take the batch (a value it does not handle): its dead letters
        from `letters` on go (Python refuses them again), and Python reduces from this batch on."""
        log.warning("%s shard %d reduces in Python from here: the native core %s", self.pipeline.pipeline, self.shard, exc)
        del out.dlq[letters:]
        self.core = None
        self._forget_reducer()
        return False

    # The transaction -----------------------------------------------------------------

    def _commit(self, out: Outgoing, checkpoint: Checkpoint) -> None:
        """The batch's records, state changes, checkpoint and consumed offsets in one
        transaction. Record timestamps are the engine's clock, never event times."""
        writer, pipeline = self.writer, self.pipeline
        writer.begin()
        if pipeline.outputs.view is not None:
            # partitioned by shard, a view partition has this shard alone as its writer (a -C right before its +C)
            writer.send_all_headed(pipeline.outputs.view.topic,
                                   [(key, value, headers) for key, value, _ts, headers in out.view],
                                   partition=self.shard if view_partitioning(pipeline) == "shard" else None)
        if pipeline.outputs.delta is not None:
            writer.send_all_headed(pipeline.outputs.delta.topic, out.delta)
        provenance = pipeline.outputs.provenance
        for letter in out.dlq:
            headers = dead_letter_headers(letter)
            if provenance:  # a dead letter's cause is its own record
                headers.append((CAUSE, self.renderer.letter_cause(letter)))
            writer.send(pipeline.dlq_topic, letter.key, encode_dead_letter(letter), headers)
        for partition, values in out.exchange.items():  # a re-grouping view's stage 1: its routed units
            writer.send_all(out.exchange_topic or pipeline.repartition_topic, [(None, v) for v in values], partition=partition)
        writer.send_all(self.state_topic, out.state, partition=self.shard)
        writer.send(pipeline.checkpoints_topic, checkpoint_key(pipeline.writer, self.shard), encode_checkpoint(checkpoint),
                    partition=self.checkpoint_partition)
        self.index.write(writer, out.view, self.checkpoint, checkpoint)  # last: it flushes the rest first
        self.hooks.stall_in_transaction()
        self.hooks.crash_point("in_txn", checkpoint.batch)
        writer.commit(self._consumed(checkpoint.offsets))
