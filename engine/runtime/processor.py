"""One micro-batch, exactly once: decode, pair, merge, reduce, commit in one transaction.

The processor runs on the driver and owns the transactional producer
`P-<writer>`. It is independent of Spark: the Spark job hands it the records of
each micro-batch (partition, offset, key, value, timestamp); tests may too.

Every batch commits, in one Kafka transaction: the view changelog, the delta
updates, the dead letters, the state changelog (`P.state`), the checkpoint
(`P.checkpoints`) and the consumer-group offsets. Records at offsets the last
checkpoint already covers are dropped first, so a replayed batch writes nothing.
When a transaction fails for any reason but a fence, the processor throws its
in-memory state away, re-initialises from Kafka and runs the batch again.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from refold import environment
from refold.codecs import output_encoders, source_decoder
from refold.config import Pipeline
from refold.connectors.runtime import Executor, Materializations
from refold.errors import RecordError, RecordSource, RefoldError, UserError
from refold.kafka.io import (
    consumer_config,
    delivery_failures,
    describe_kafka_error,
    producer_config,
)
from refold.model.changelog import ChangelogEvent, Op
from refold.model.reasons import Reason
from refold.recovery.records import (
    Checkpoint,
    DeadLetter,
    PendingRecord,
    dead_letter_headers,
    encode_checkpoint,
    encode_dead_letter,
)
from refold.recovery.restore import recover
from refold.reduce import Rejected, SourceEvent, ViewChange, compact_changes, make_reducer

log = logging.getLogger(__name__)

_FENCED_CODES = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED}
_RETRACT_FORM = {Op.CORRECT_FROM: Op.RETRACT, Op.CORRECT_TO: Op.APPEND}


class FencedError(UserError):
    """Another instance of this pipeline started with the same transactional id."""


class TransactionFailed(RefoldError):
    """A transaction did not commit; the batch must be run again from Kafka's state."""


class InputRecord(NamedTuple):
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


@dataclass(slots=True)
class BatchStats:
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


@dataclass(slots=True)
class _Outgoing:
    """The records of one batch, in the order they will be produced."""

    view: list[tuple[bytes, bytes | None, int | None]] = field(default_factory=list)
    delta: list[tuple[bytes, bytes]] = field(default_factory=list)
    dlq: list[DeadLetter] = field(default_factory=list)
    state: list[tuple[bytes, bytes | None]] = field(default_factory=list)
    delta_rows: list[dict[str, Any]] = field(default_factory=list)  # for delta materializations


class BatchProcessor:
    """Called by the Spark job's foreachBatch on the driver, one batch at a time."""

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], executor: Executor | None = None) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.topic = pipeline.source.topic
        self.decoder = source_decoder(pipeline)
        self.view_encoder, self.delta_encoder = output_encoders(pipeline)
        self.aborts = 0  # transactions that failed and were run again
        self.producer: Producer | None = None
        self.last = BatchStats()
        self._timeout_ms = environment.transaction_timeout_ms()
        self._txn_started = 0.0
        self._wedged: list[Producer] = []  # producers stuck in a call that ignored its timeout
        self._group = Consumer(consumer_config(settings, **{"group.id": f"refold.{pipeline.pipeline}"}))
        # outputs.materialize: Flow's protocol around each batch (refold.connectors.runtime)
        self.materializations = Materializations.from_pipeline(pipeline, executor)
        self._start()

    # Lifecycle -----------------------------------------------------------------------

    def _start(self) -> None:
        """Fence older instances, abort our open transaction, rebuild state from Kafka."""
        self._close_producer()
        conf = producer_config(
            self.settings,
            **{
                "transactional.id": self.pipeline.transactional_id,
                "transaction.timeout.ms": self._timeout_ms,
                # a Python callback per failed record only, not per record (2-3 per event):
                # 250k records produced and committed in 0.9 s instead of 1.5 s here
                "delivery.report.only.error": True,
            },
        )
        producer = Producer(conf)
        try:
            producer.init_transactions(60)
        except KafkaException as exc:
            raise UserError(f"cannot initialise transactions as {self.pipeline.transactional_id!r}: "
                            f"{describe_kafka_error(exc)}") from exc
        self.producer = producer
        started = time.monotonic()
        with collector_paused():
            recovered = recover(self.pipeline, self.settings)
            self.reducer = make_reducer(self.pipeline.view)
            self.reducer.restore(recovered.state)
        self.checkpoint = recovered.checkpoint or Checkpoint(
            pipeline=self.pipeline.pipeline,
            writer=self.pipeline.writer,
            batch=0,
            source_topic=self.topic,
            offsets={},
            pending={},
            records_in=0,
            records_out=0,
            dlq=0,
            committed_at=0,
            driver_checkpoints={},
        )
        if self.materializations is not None:
            self.materializations.open(self.checkpoint)
        log.info(
            "recovered %s: batch %d, offsets %s, %d state records (%.1fs)",
            self.pipeline.pipeline,
            self.checkpoint.batch,
            self.checkpoint.offsets,
            len(recovered.state),
            time.monotonic() - started,
        )

    def _close_producer(self) -> None:
        if self.producer is not None:
            if self.producer not in self._wedged:
                with contextlib.suppress(KafkaException):
                    self.producer.flush(5)
            self.producer = None

    def _bounded(self, what: str, seconds: float, call: Callable[[], None]) -> None:
        """Run a transactional call that may ignore its own timeout, with a deadline.

        librdkafka's send_offsets_to_transaction can block forever when the group
        coordinator went away (librdkafka#5456, #5511: found by `make chaos` after a
        broker restart). Past the deadline the batch counts as failed: the processor
        re-initialises with a new producer (whose init_transactions fences and aborts
        the stuck one) and replays the batch. The stuck producer is kept referenced,
        never destroyed under the thread that still waits in it.
        """
        outcome: list[BaseException | None] = []
        thread = threading.Thread(target=_call_into, args=(call, outcome), name=f"refold-{what}", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            assert self.producer is not None
            self._wedged.append(self.producer)
            raise TransactionFailed(f"{what} did not return within {seconds:.0f}s (librdkafka#5456)")
        error = outcome[0] if outcome else None
        if error is not None:
            raise error

    def close(self) -> None:
        if self.materializations is not None:
            self.materializations.close()
        self._close_producer()
        self._group.close()

    @property
    def offsets(self) -> dict[int, int]:
        return dict(self.checkpoint.offsets)

    # The batch -------------------------------------------------------------------------

    def process(self, records: Sequence[InputRecord]) -> BatchStats | None:
        """Reduce and commit one batch. Returns None when every record was already committed."""
        with collector_paused():
            for attempt in range(1, 4):
                try:
                    return self._process_once(records)
                except TransactionFailed as exc:
                    self.aborts += 1
                    log.warning("batch transaction failed (attempt %d): %s; re-initialising from Kafka", attempt, exc)
                    self._start()
            raise RefoldError("the batch's transaction failed three times; giving up")

    def _process_once(self, records: Sequence[InputRecord]) -> BatchStats | None:
        started = time.monotonic()
        committed = self.checkpoint.offsets
        fresh = [r for r in records if r.offset >= committed.get(r.partition, 0)]
        if not fresh:
            return None
        out = _Outgoing()
        units, pending, in_count, tombstones = self._units(fresh, out)
        _crash_point("mid_batch", self.checkpoint.batch + 1)
        changes: list[tuple[list[ViewChange], int]] = []
        for unit in units:
            try:
                changes.append((self.reducer.apply([event for event, _ in unit]), unit[0][0].tag[0]))
            except Rejected as rejected:
                for index, (_event, record) in enumerate(unit):
                    if index != rejected.index and unit[rejected.index][1] is record:
                        continue  # one dead letter per input record (a Debezium update is a pair)
                    reason = rejected.reason if index == rejected.index else Reason.CORRECTION_PAIR_REJECTED
                    self._dead_letter(out, record, reason, None)
        self._render(changes, out)
        out.dlq.sort(key=lambda letter: (letter.partition, letter.offset))  # input order
        out.state = self.reducer.take_state_changes()
        offsets = dict(committed)
        for record in fresh:
            offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
        stats = BatchStats(
            batch=self.checkpoint.batch + 1,
            records_in=in_count,
            records_out=len(out.view) + len(out.delta),
            dead_letters=len(out.dlq),
            skipped=len(records) - len(fresh),
            tombstones=tombstones,
            out_by_topic=self._out_by_topic(out),
        )
        checkpoint = replace(
            self.checkpoint,
            batch=stats.batch,
            offsets=offsets,
            pending=pending,
            records_in=self.checkpoint.records_in + stats.records_in,
            records_out=self.checkpoint.records_out + stats.records_out,
            dlq=self.checkpoint.dlq + stats.dead_letters,
            committed_at=int(time.time() * 1000),
        )
        if self.materializations is not None:  # Load, Flush, Store, StartCommit
            flat = [change for unit_changes, _ in changes for change in unit_changes]
            driver_checkpoints = self.materializations.commit(checkpoint, flat, out.delta_rows, self.reducer.view)
            checkpoint = replace(checkpoint, driver_checkpoints=driver_checkpoints)
        commit_started = time.monotonic()
        self._commit(out, checkpoint)
        stats.commit_seconds = time.monotonic() - commit_started
        _crash_point("after_commit", checkpoint.batch)
        if self.materializations is not None:
            self.materializations.acknowledge(checkpoint.batch)
        self.checkpoint = checkpoint
        stats.seconds = time.monotonic() - started
        stats.committed_at = time.time()
        self.last = stats
        return stats

    def _units(
        self, fresh: Sequence[InputRecord], out: _Outgoing
    ) -> tuple[list[list[tuple[SourceEvent, InputRecord]]], dict[int, PendingRecord], int, int]:
        """Decode and pair each partition's records in offset order, then merge the
        partitions deterministically by the tag of each unit's first event."""
        by_partition: dict[int, list[InputRecord]] = {}
        for record in fresh:
            by_partition.setdefault(record.partition, []).append(record)
        pending_out = dict(self.checkpoint.pending)
        streams = []
        tombstones = 0
        for partition in sorted(by_partition):
            rows = sorted(by_partition[partition], key=lambda r: r.offset)
            held = pending_out.pop(partition, None)
            if held is not None:
                rows.insert(0, InputRecord(partition, held.offset, held.key, held.value, held.timestamp))
            units: list[list[tuple[SourceEvent, InputRecord]]] = []
            open_c: tuple[SourceEvent, InputRecord] | None = None
            decoded = self.decoder.decode_records(
                [r.value for r in rows], [r.offset for r in rows], topic=self.topic, partition=partition
            )
            for item, event in self._events(rows, decoded, out):
                if item is None:
                    tombstones += 1
                    continue
                record = item
                if open_c is not None:
                    first, open_c = open_c, None
                    if event is not None and event.op is Op.CORRECT_TO and record.key == first[1].key:
                        units.append([first, (event, record)])
                        continue
                    self._dead_letter(out, first[1], Reason.UNPAIRED_CORRECT_FROM, None)
                if event is None:
                    continue
                if event.op is Op.CORRECT_FROM:
                    open_c = (event, record)
                elif event.op is Op.CORRECT_TO:
                    self._dead_letter(out, record, Reason.ORPHAN_CORRECT_TO, None)
                else:
                    units.append([(event, record)])
            if open_c is not None:  # its +C comes in a later batch
                record = open_c[1]
                pending_out[partition] = PendingRecord(record.offset, record.key, record.value or b"", record.timestamp)
            streams.append(units)
        merged = list(heapq.merge(*streams, key=lambda unit: unit[0][0].tag))
        in_count = len(fresh)
        return merged, pending_out, in_count, tombstones

    def _events(
        self, rows: Sequence[InputRecord], decoded: Sequence[list[ChangelogEvent] | RecordError], out: _Outgoing
    ) -> Iterable[tuple[InputRecord | None, SourceEvent | None]]:
        """Each record's events in order (None for a bad one, dead-lettered); a record
        with no events (a tombstone) as (None, None)."""
        for record, result in zip(rows, decoded, strict=True):
            if isinstance(result, RecordError):
                yield record, self._event(record, result, out)
            elif not result:
                yield None, None
            else:
                for event in result:
                    yield record, self._event(record, event, out)

    def _out_by_topic(self, out: _Outgoing) -> dict[str, int]:
        counts: dict[str, int] = {}
        if self.pipeline.outputs.view is not None:
            counts[self.pipeline.outputs.view.topic] = len(out.view)
        if self.pipeline.outputs.delta is not None:
            counts[self.pipeline.outputs.delta.topic] = len(out.delta)
        counts[self.pipeline.dlq_topic] = len(out.dlq)
        return counts

    def _event(self, record: InputRecord, event: ChangelogEvent | RecordError, out: _Outgoing) -> SourceEvent | None:
        if isinstance(event, RecordError):
            self._dead_letter(out, record, event.reason, event.detail)
            return None
        event_time = event.event_time if event.event_time is not None else record.timestamp
        row = event.row  # decoders make a fresh dict per event; other mappings are copied
        return SourceEvent(event.op, row if type(row) is dict else dict(row),
                           (event_time, record.partition, record.offset))

    def _dead_letter(self, out: _Outgoing, record: InputRecord, reason: str, detail: str | None) -> None:
        if self.pipeline.strict:
            raise RecordError(
                reason, RecordSource(self.topic, record.partition, record.offset), detail=detail
            )
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
                pipeline=self.pipeline.pipeline,
            )
        )

    def _render(self, changes: list[tuple[list[ViewChange], int]], out: _Outgoing) -> None:
        spec = self.pipeline.outputs.view
        if spec is not None:
            if spec.emit == "per_batch":
                flat = [c for unit_changes, _ in changes for c in unit_changes]
                timed: Iterable[tuple[ViewChange, int | None]] = ((c, None) for c in compact_changes(flat))
            else:
                timed = ((c, ts) for unit_changes, ts in changes for c in unit_changes)
            form = spec.form
            key_json: dict[tuple[Any, ...], bytes] = {}  # a key's changes in a batch share its bytes
            for change, ts in timed:
                key = key_json.get(change.key)
                if key is None:
                    key = key_json[change.key] = change.key_json()
                if form == "upsert":
                    if change.op is Op.CORRECT_FROM:
                        continue
                    value = None if change.op is Op.RETRACT else self.view_encoder.encode(change.row)
                else:
                    op = _RETRACT_FORM.get(change.op, change.op) if form == "retract" else change.op
                    value = self.view_encoder.encode(change.row, op)
                out.view.append((key, value, ts))
        deltas = out.delta_rows = self.reducer.take_deltas()
        if self.pipeline.outputs.delta is not None:
            key_columns = self.pipeline.view.key
            for row in deltas:
                key = orjson.dumps({k: row[k] for k in key_columns})
                out.delta.append((key, self.delta_encoder.encode(row)))

    # The transaction -----------------------------------------------------------------

    def _commit(self, out: _Outgoing, checkpoint: Checkpoint) -> None:
        producer = self.producer
        assert producer is not None
        errors, on_delivery = delivery_failures()

        def send(topic: str, key: bytes | None, value: bytes | None, **kwargs: Any) -> None:
            while True:
                try:
                    producer.produce(topic, value, key, on_delivery=on_delivery, **kwargs)
                    return
                except BufferError:
                    producer.poll(0.05)

        try:
            self._txn_started = time.monotonic()
            producer.begin_transaction()
            if self.pipeline.outputs.view is not None:
                view_topic = self.pipeline.outputs.view.topic
                for key, value, _ts in out.view:
                    # Record timestamps are the engine's clock, never event times: an old
                    # event time would let retention delete the record.
                    send(view_topic, key, value)
            if self.pipeline.outputs.delta is not None:
                for key, value in out.delta:
                    send(self.pipeline.outputs.delta.topic, key, value)
            for letter in out.dlq:
                send(self.pipeline.dlq_topic, letter.key, encode_dead_letter(letter), headers=dead_letter_headers(letter))
            for key, value in out.state:
                send(self.pipeline.state_topic, key, value)
            send(self.pipeline.checkpoints_topic, self.pipeline.writer.encode(), encode_checkpoint(checkpoint))
            _test_stall()
            _crash_point("in_txn", checkpoint.batch)
            producer.flush(120)
            if errors:
                raise KafkaException(errors[0])
            positions = [TopicPartition(self.topic, p, o) for p, o in sorted(checkpoint.offsets.items())]
            metadata = self._group.consumer_group_metadata()
            self._bounded("send_offsets_to_transaction", 45,
                          lambda: producer.send_offsets_to_transaction(positions, metadata, 30))
            producer.commit_transaction(120)
        except KafkaException as exc:
            self._fail(exc)
        except SystemError as exc:
            # A fatal error (a fence while records are in flight) is raised inside flush()
            # while the client goes on calling the failed records' delivery callbacks, so
            # flush() ends in a SystemError caused by it (confluent-kafka-python#865, still
            # in 2.16: its error_cb raises fatal errors whatever callback is set).
            if isinstance(exc.__cause__, KafkaException):
                self._fail(exc.__cause__)
            raise

    def _fail(self, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.code() == KafkaError._FATAL:
            err = self._fatal_cause(err)
        open_ms = (time.monotonic() - self._txn_started) * 1000
        # The coordinator aborts a transaction that outlives transaction.timeout.ms by
        # bumping the epoch, which the client reports as a fence. Only a fence inside
        # the timeout is another instance taking over; after it, re-initialise and replay.
        if err is not None and err.code() in _FENCED_CODES and open_ms < self._timeout_ms:
            self.producer = None  # fenced for good: nothing of it to flush or abort
            raise FencedError(
                f"fenced: another instance of pipeline {self.pipeline.pipeline!r} took over "
                f"transactional id {self.pipeline.transactional_id!r}; this one stops"
            ) from exc
        producer = self.producer
        if producer is not None and err is not None and err.txn_requires_abort():
            try:
                producer.abort_transaction(60)
            except KafkaException as abort_exc:
                log.warning("abort failed too: %s", describe_kafka_error(abort_exc))
        raise TransactionFailed(describe_kafka_error(exc)) from exc

    def _fatal_cause(self, err: KafkaError) -> KafkaError:
        """Why the producer is in a fatal state: `produce()` says only `_FATAL` (a zombie
        fenced while it sends; found by `make chaos`), the transactional API names the cause."""
        if self.producer is not None:
            try:
                self.producer.abort_transaction(5)
            except KafkaException as exc:
                if exc.args and isinstance(exc.args[0], KafkaError):
                    return exc.args[0]
        return err


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a batch (or a restore) allocates,
    and what survives it frozen after it.

    A batch makes a few objects per event, most of them state that lives on; with the
    collector on, its young-generation collections keep firing and promoting that state,
    and each full collection rescans all of it (measured: ~35 % of a batch's CPU at 20k
    keys; and, with the collector back on between batches, full collections of 0.4-0.8 s
    at ~250k keys, which were the latency's p99). So after the batch
    `gc.freeze()` moves every survivor out of the collector's sight: later collections
    only scan what is newer than the last batch. Reference counting still frees frozen
    objects; only cycles stay: py4j's, ~15 objects a batch (a `JavaObject` and the
    `JavaMember`s it caches); a batch's own code makes none (measured: a collection after
    each 100k-event batch of `bench.hotpath` found 0 unreachable objects and cost 0.43-0.48
    CPU s, ~6 % of the batch, so there is none after a batch any more). Every
    `FULL_COLLECTION_SECONDS` everything is unfrozen and collected once (one full pause,
    not one every few batches). (The first freeze, with no periodic full collection, kept
    every batch's cyclic garbage for ever.)"""
    global _last_full_collection
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        # frozen before the collector is on again: the first allocation after it would
        # otherwise start a young collection over everything the batch left
        gc.freeze()
        if time.monotonic() - _last_full_collection >= FULL_COLLECTION_SECONDS:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            _last_full_collection = time.monotonic()
        gc.enable()


FULL_COLLECTION_SECONDS = 600.0
_last_full_collection = time.monotonic()


def _call_into(call: Callable[[], None], outcome: list[BaseException | None]) -> None:
    try:
        call()
    except BaseException as exc:  # handed to the waiting thread
        outcome.append(exc)
    else:
        outcome.append(None)


_stalled = False


def _test_stall() -> None:
    """Chaos hook: REFOLD_TEST_STALL_IN_TXN_SECONDS keeps the first transaction open that
    long, or, with REFOLD_TEST_STALL_UNTIL=<path>, until that file exists (at most that long)."""
    global _stalled
    seconds = os.environ.get("REFOLD_TEST_STALL_IN_TXN_SECONDS")
    if seconds and not _stalled:
        _stalled = True
        release = os.environ.get("REFOLD_TEST_STALL_UNTIL")
        log.warning("test hook: stalling %ss inside the transaction%s", seconds,
                    f" or until {release} exists" if release else "")
        deadline = time.monotonic() + float(seconds)
        while time.monotonic() < deadline and not (release and os.path.exists(release)):
            time.sleep(0.1)


def _crash_point(where: str, batch: int) -> None:
    """Chaos hook: REFOLD_TEST_CRASH="<where>:<batch>" kills this process with SIGKILL
    there (`mid_batch`: state changed, nothing sent; `in_txn`: records sent, not
    committed; `after_commit`: committed, before Spark records the batch)."""
    wanted = os.environ.get("REFOLD_TEST_CRASH")
    if wanted and wanted == f"{where}:{batch}":
        log.warning("test hook: kill -9 at %s of batch %d", where, batch)
        os.kill(os.getpid(), signal.SIGKILL)
