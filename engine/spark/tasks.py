"""The reducing Spark tasks: each shard's part of a micro-batch runs in a Spark task, on
an executor's Python worker (`mapInArrow` inside the job's `foreachBatch`).

Spark's Kafka source plans one task per source partition, so a co-partitioned view's
shard p is the task of partition p; any other view's batch is coalesced to one task,
shard 0. A task hands its records to the shard's `ShardProcessor`
(`refold.runtime.shard`), which commits them in the shard's own transaction, and
yields one small summary row per shard (`SUMMARY`) for the driver's metrics, status
and errors. The driver reduces nothing.

A Python worker keeps the processors of the shards it ran (`_RUNNING`): their
transactional producer, their reducer's keys and their checkpoint. That is a speed-up
only (any idle worker of an executor may get a shard's next task, and idle workers
exit): a kept processor is used again only when its shard's store still carries the
stamp of its last commit (`ShardProcessor.resume`), and a kept processor whose writer
turns out fenced (another worker of this run took the shard over and committed since)
is replaced by a new one, which initialises the writer and reads the committed
checkpoint. A processor made in this task that is fenced was overtaken by a newer
attempt of the shard: when the committed checkpoint is of a newer engine run, the
task reports `FencedError` (the engine stops: another engine took over); otherwise
it starts again after a random pause, at most `FENCED_ATTEMPTS` times.

A re-grouping view in `shards` (`refold.runtime.exchange`) runs two kinds of task per
batch: stage 1 (`stage="route"`), one per source partition as above, then, once the
driver closed the batch, stage 2 (`stage="apply"`), one per shard over a one-row-per-
shard frame, each reading its `P.repartition` partition through the close record.

Refold's own errors (a record refused in strict mode, messages keyed otherwise than
`source.key` says, a fence, a transaction that failed three times) come back in the
summary, so the driver raises them as they are; anything else fails the task, and
Spark runs it again (a Python worker killed mid-batch, say).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import random
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from refold.config import Pipeline
from refold.errors import OperationalError, RecordError, RefoldError, UserError
from refold.kafka.transactions import FencedError
from refold.plan import RIGHT_PARTITIONS, regroup_topic
from refold.runtime.batch import InputRecord
from refold.runtime.exchange import ApplyProcessor, RouteProcessor, read_closed
from refold.runtime.hooks import Hooks
from refold.runtime.joingroup import RegroupProcessor
from refold.runtime.joins import JoinShardProcessor
from refold.runtime.joinx import JoinApplyProcessor, JoinRouteProcessor
from refold.runtime.shard import BatchStats, ShardProcessor
from refold.runtime.shards import KeyCheck, plan_shards
from refold.runtime.tops import RankProcessor, tops_topic
from refold.spark import hosts
from refold.state.store import default_root

log = logging.getLogger(__name__)

SUMMARY = (
    "shard int, batch long, records_in long, records_out long, dead_letters long, skipped long, "
    "tombstones long, seconds double, commit_seconds double, committed_at double, out_by_topic string, "
    "offsets string, aborts long, recovered string, recovery string, worker int, attempt int, error_kind string, error string, "
    "error_pickle binary"
)
ERRORS: dict[str, type[RefoldError]] = {  # the most specific first
    "fenced": FencedError,
    "record": RecordError,
    "user": UserError,
    "operational": OperationalError,
    "refold": RefoldError,
}

FENCED_ATTEMPTS = 5  # new processors a task makes after fences before it gives up (Spark may run it again)
_RUNNING: dict[tuple[str, str, int], _Kept] = {}  # this Python worker's shards, by (pipeline, writer, shard)


KEPT_IDLE_SECONDS = 120.0  # a kept processor no task used for this long is closed


@dataclass(slots=True)
class _Kept:
    processor: ShardProcessor
    identity: bytes  # the pipeline, settings and run it was made for
    used: float = field(default_factory=time.monotonic)


FILE_SETTINGS = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.keystore.location",
                 "ssl.crl.location", "sasl.kerberos.keytab")  # librdkafka settings that name a file


def check_files(settings: dict[str, Any]) -> None:
    """UserError naming the setting, the file and this machine when a file the Kafka
    settings name is missing here: every executor needs its own copy (a truststore,
    a client certificate, a keytab) at the same path."""
    for key in FILE_SETTINGS:
        path = settings.get(key)
        if isinstance(path, str) and path and not os.path.exists(path):
            raise UserError(
                f"kafka.{key}: {path} does not exist on the Spark executor on host {socket.gethostname()}; "
                "every executor's machine needs the file at the same path (or ship it with spark.files "
                "and name it where the executors keep it)"
            )


@dataclass(frozen=True, repr=False)
class ShardTask:
    """`mapInArrow`'s function for one micro-batch (pickled to the executors).

    `run`: the engine run (its driver's start, epoch ms); `checkpoint_partitions`:
    how many partitions `P.checkpoints` has (a shard's records go to shard mod that);
    `first_of_run`: this batch is the run's first, whose first record keyed otherwise
    stops the engine (later ones are dead letters); `stage`: the view's shards
    (`view`), or a re-grouping view's stage 1 (`route`), stage 2 (`apply`, through
    the close record `close`), a global Top-N's stage 3 (`top`, refold.runtime.tops) or a
    regrouping join's stage 3 (`group`, refold.runtime.joingroup)."""

    pipeline: Pipeline
    settings: dict[str, Any]
    hooks: Hooks
    run: int
    checkpoint_partitions: int
    first_of_run: bool
    stage: Literal["view", "route", "apply", "top", "group"] = "view"
    close: bytes | None = None

    __name__ = "refold_shard_task"  # what Spark's plan and UI show: never the settings

    def __repr__(self) -> str:  # Spark may print the function: its Kafka settings hold secrets
        return f"ShardTask(pipeline={self.pipeline.pipeline!r}, run={self.run})"

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if hosts.enabled():  # each shard in its host (refold.spark.hosts), which keeps it warm
            yield from self._hosted(batches)
            return
        if self.stage in ("apply", "top", "group"):  # the shards' numbers in, each shard's input read from P.repartition
            for index in [i for batch in batches for i in batch.column("id").to_pylist()]:
                yield _summary(index, *self._run_shard(index, None))
            return
        records = input_records(batches)
        if not records:
            return
        for index, part in sorted(plan_shards(self.pipeline).split(records).items()):
            yield self._shard_summary(index, part)

    def _hosted(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Each shard's part of the task's records, as Arrow, to its host; the hosts' summaries."""
        attempt = _attempt()
        state_root = self.pipeline.spark.state_dir or str(default_root())
        arrived = list(batches)
        if self.stage in ("apply", "top", "group"):
            parts: list[tuple[int, pa.Table | None]] = [
                (i, None) for batch in arrived for i in batch.column("id").to_pylist()]
        else:
            parts = split_table(pa.Table.from_batches(arrived) if arrived else None,
                                plan_shards(self.pipeline).co_partitioned)
        for index, table in parts:
            yield hosts.run_hosted(hosts.socket_path(self._key(index), state_root), self, index, table, attempt)

    def _shard_summary(self, index: int, part: list[InputRecord] | None, attempt: int | None = None) -> pa.RecordBatch:
        """The shard's part run (`_run_shard`), as its summary row; this process's reducers
        then bounded (`_bound_memory`)."""
        summary = _summary(index, *self._run_shard(index, part), attempt=attempt)
        _bound_memory(self.pipeline.spark.state_cache_keys, self._key(index))
        return summary

    def _run_shard(self, index: int, part: list[InputRecord] | None) -> tuple[
            BatchStats | None, ShardProcessor | None, BaseException | None]:
        """The shard's part (None: stage 2's, read through the close), committed; its
        stats (None: all of it was committed before), its processor, or the Refold
        error that stopped it."""
        processor: ShardProcessor | None = None
        try:
            check_files(self.settings)
            processor = self._processor(index)
            for attempt in range(FENCED_ATTEMPTS):
                try:
                    if not self.first_of_run and self.stage in ("view", "route"):  # past a run's first batch, bad keys are dead letters
                        if processor.reader.keys is not None:
                            processor.reader.keys.verified = True
                        if processor.tables is not None:
                            processor.tables.verified = True
                    records = part if part is not None else self._closed(index, processor)
                    stats = processor.process(records)
                    if not hosts.hosting():  # a host keeps the store open (`release_wanted`)
                        processor.suspend()
                    return stats, processor, None
                except FencedError:
                    # another attempt of this shard (or a newer run) initialised its writer
                    # since this processor did: start again, unless a newer run holds it.
                    # Two attempts on two machines fence each other in turn; a random,
                    # growing pause lets one of them finish while the other waits.
                    self._forget(index)
                    time.sleep(random.uniform(0.25, 0.5) * 2**attempt)
                    processor = self._new(index)
            raise OperationalError(f"shard {index}: fenced by other attempts of its task {FENCED_ATTEMPTS} times")
        except RefoldError as exc:
            self._forget(index)
            return None, processor, exc
        except BaseException:
            self._forget(index)
            raise

    @functools.cached_property
    def _identity(self) -> bytes:
        """What a kept processor must have been made for: this pipeline, settings and run."""
        return hashlib.sha256(
            self.pipeline.model_dump_json().encode() + orjson.dumps(self.settings, option=orjson.OPT_SORT_KEYS)
            + str(self.run).encode()
        ).digest()

    def _processor(self, index: int) -> ShardProcessor:
        """The kept processor of the shard when it is still current, else a new one."""
        kept = _RUNNING.get(self._key(index))
        if kept is not None and kept.identity == self._identity:
            if kept.processor.resume():  # raising, it is forgotten by `_run_shard`
                return kept.processor
            log.info("shard %d: its store moved since this worker's last batch; starting it again", index)
        self._forget(index)
        return self._new(index)

    def _closed(self, index: int, processor: ShardProcessor) -> list[InputRecord]:
        """Stage 2's input: its `P.repartition` partition from its checkpoint through the close."""
        assert self.close is not None
        return read_closed(self.settings, self.pipeline, index, processor.offsets.get(index, 0), self.close,
                           topic={"top": tops_topic(self.pipeline), "group": regroup_topic(self.pipeline)}.get(self.stage))

    def _new(self, index: int) -> ShardProcessor:
        """A new processor of the shard (its writer initialised, its checkpoint read, its
        store brought to it), kept for the worker's next tasks. FencedError when a newer
        engine run has claimed the shard."""
        kind: type[ShardProcessor] = ShardProcessor
        if self.pipeline.view.join is None:
            kind = {"view": ShardProcessor, "route": RouteProcessor, "apply": ApplyProcessor,
                    "top": RankProcessor}[self.stage]
        else:
            kind = {"route": JoinRouteProcessor, "apply": JoinApplyProcessor, "group": RegroupProcessor}.get(
                self.stage, JoinShardProcessor)
        processor = kind(
            self.pipeline,
            self.settings,
            index,
            hooks=self.hooks,
            keys=KeyCheck(self.pipeline) if self.stage in ("view", "route") else None,
            checkpoint_partition=index % self.checkpoint_partitions,
            run=self.run,
        )
        if processor.checkpoint.run > self.run:
            processor.close()
            raise FencedError(
                f"pipeline {self.pipeline.pipeline!r} shard {index}: a newer engine run (started "
                f"{processor.checkpoint.run}, this one {self.run}) holds it; this one stops"
            )
        _RUNNING[self._key(index)] = _Kept(processor, self._identity)
        return processor

    def _key(self, index: int) -> tuple[str, str, int]:
        writer = self.pipeline.writer + {"apply": ".view", "top": ".top", "group": ".group"}.get(self.stage, "")
        return (self.pipeline.pipeline, writer, index)

    def _forget(self, index: int) -> None:
        kept = _RUNNING.pop(self._key(index), None)
        if kept is not None:
            try:
                kept.processor.close()
            except Exception as exc:  # closing a processor that failed: its own error is reported
                log.warning("shard %d: closing its processor: %s", index, exc)


def input_records(batches: Iterable[pa.RecordBatch]) -> list[InputRecord]:
    """The task's rows (`partition`, `offset`, `key`, `value`, `ts`) as `InputRecord`s."""
    records: list[InputRecord] = []
    for batch in batches:
        columns = batch.to_pydict()
        records.extend(
            InputRecord(p, o, k, v, ts if ts is not None else 0)
            for p, o, k, v, ts in zip(
                columns["partition"], columns["offset"], columns["key"], columns["value"], columns["ts"],
                strict=True,
            )
        )
    return records


def split_table(table: pa.Table | None, co_partitioned: bool) -> list[tuple[int, pa.Table | None]]:
    """A task's rows by shard (`ShardPlan.split`, in Arrow): partition p's rows for shard p
    of a co-partitioned view, all of them for shard 0 of any other."""
    if table is None or table.num_rows == 0:
        return []
    if not co_partitioned:
        return [(0, table)]
    shards = pc.bit_wise_and(table.column("partition"), RIGHT_PARTITIONS - 1)  # (a join's right partitions too)
    return [(p, table.filter(pc.equal(shards, p))) for p in sorted(pc.unique(shards).to_pylist())]


def run_request(task: ShardTask, index: int, table: pa.Table | None, attempt: int) -> pa.RecordBatch:
    """A shard host's answer to one task (`refold.spark.hosts`): the shard's part
    reduced and committed here, as the task would have in its worker."""
    return task._shard_summary(index, None if table is None else input_records(table.to_batches()), attempt)


def release_wanted() -> None:
    """A shard host's kept stores that another process waits for, let go (`ShardStore.wanted`):
    the next task of the shard here takes its store again and checks its stamp."""
    for kept in _RUNNING.values():
        store = kept.processor.store
        if store is not None and store.wanted:
            kept.processor.suspend()


def close_kept() -> None:
    """Close every kept processor (a shard host's end)."""
    for key in list(_RUNNING):
        kept = _RUNNING.pop(key)
        try:
            kept.processor.close()
        except Exception as exc:
            log.warning("shard %d: closing its processor: %s", key[2], exc)


def _bound_memory(limit: int, current: tuple[str, str, int]) -> None:
    """Keep this worker's reducers to `limit` keys together (`spark.state_cache_keys`):
    the least recently used shards' reducers start empty first (their keys stay in the
    stores); the shard just run keeps its own (its `_load` bounds it). Processors no
    task used for `KEPT_IDLE_SECONDS` (a shard that moved to another worker, a finished
    run's) are closed: their producers and consumers go too."""
    now = time.monotonic()
    if current in _RUNNING:
        kept = _RUNNING.pop(current)
        kept.used = now
        _RUNNING[current] = kept  # most recently used last
    for key, kept in list(_RUNNING.items()):
        if now - kept.used > KEPT_IDLE_SECONDS:
            del _RUNNING[key]
            try:
                kept.processor.close()
            except Exception as exc:  # an old processor's broker may be gone; it holds nothing to lose
                log.warning("shard %d: closing an idle processor: %s", key[2], exc)
    held = sum(kept.processor.held_keys for kept in _RUNNING.values())
    for key, kept in list(_RUNNING.items()):
        if held <= limit or key == current:
            break
        held -= kept.processor.held_keys
        kept.processor.forget()


def _summary(index: int, stats: BatchStats | None, processor: ShardProcessor | None,
             error: BaseException | None, attempt: int | None = None) -> pa.RecordBatch:
    kind = None
    if error is not None:
        kind = next(name for name, cls in ERRORS.items() if isinstance(error, cls))
    stats = stats or BatchStats(batch=0)
    recovery = processor.recovery if processor is not None else None
    if processor is not None:
        processor.recovery = None  # reported once: when the processor was made
    row = {
        "shard": index,
        "batch": stats.batch,
        "records_in": stats.records_in,
        "records_out": stats.records_out,
        "dead_letters": stats.dead_letters,
        "skipped": stats.skipped,
        "tombstones": stats.tombstones,
        "seconds": stats.seconds,
        "commit_seconds": stats.commit_seconds,
        "committed_at": stats.committed_at,
        "out_by_topic": orjson.dumps(stats.out_by_topic).decode(),
        "offsets": orjson.dumps({str(p): o for p, o in (processor.offsets if processor else {}).items()}).decode(),
        "aborts": processor.aborts if processor is not None else 0,
        "recovered": recovery.how if recovery is not None else None,
        "recovery": (f"{recovery.reason}; {recovery.records_read} P.state records read, {recovery.seconds:.1f}s; "
                     f"{processor.cores if processor is not None else 'Python core'}"
                     if recovery is not None else None),
        "worker": os.getpid(),
        "attempt": _attempt() if attempt is None else attempt,
        "error_kind": kind,
        "error": str(error) if error is not None else None,
        "error_pickle": _pickled(error),
    }
    return pa.RecordBatch.from_pylist([row], schema=summary_schema())


def _attempt() -> int:
    """Which attempt of its Spark task this is (0: the first; more: Spark ran it again)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.attemptNumber() if context is not None else 0


def summary_schema() -> pa.Schema:
    return pa.schema([
        ("shard", pa.int32()), ("batch", pa.int64()), ("records_in", pa.int64()), ("records_out", pa.int64()),
        ("dead_letters", pa.int64()), ("skipped", pa.int64()), ("tombstones", pa.int64()),
        ("seconds", pa.float64()), ("commit_seconds", pa.float64()), ("committed_at", pa.float64()),
        ("out_by_topic", pa.string()), ("offsets", pa.string()), ("aborts", pa.int64()),
        ("recovered", pa.string()), ("recovery", pa.string()), ("worker", pa.int32()), ("attempt", pa.int32()), ("error_kind", pa.string()),
        ("error", pa.string()),
        ("error_pickle", pa.binary()),
    ])


def _pickled(error: BaseException | None) -> bytes | None:
    """The error as it is, when it survives a pickle round trip (the driver raises it)."""
    if error is None:
        return None
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        return None
    return data


def summary_offsets(rows: list[dict[str, Any]]) -> dict[int, int]:
    """The offsets committed by the tasks of these summaries that did not fail, by partition."""
    return {int(p): o for row in rows if row["error_kind"] is None for p, o in orjson.loads(row["offsets"]).items()}


def summary_stats(row: dict[str, Any]) -> BatchStats:
    """A task's summary row (`SUMMARY`) as the stats of its shard's batch."""
    return BatchStats(
        batch=row["batch"],
        records_in=row["records_in"],
        records_out=row["records_out"],
        dead_letters=row["dead_letters"],
        skipped=row["skipped"],
        tombstones=row["tombstones"],
        seconds=row["seconds"],
        commit_seconds=row["commit_seconds"],
        committed_at=row["committed_at"],
        out_by_topic=orjson.loads(row["out_by_topic"]),
    )


def reported_error(row: dict[str, Any]) -> RefoldError:
    """The Refold error a task's summary row reports, as the task raised it when it can
    be carried whole, else as its kind with its message."""
    data = row.get("error_pickle")
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:
            error = None
        if isinstance(error, RefoldError):
            return error
    return ERRORS[row["error_kind"]](row["error"])
