"""The materialization runtime: drives every driver of a pipeline, one transaction per batch.

A shard's processor (`refold.runtime.shard.ShardProcessor`) calls it in the shard's
Spark task:

- `open(checkpoint, view)` at start, with the last committed Kafka checkpoint:
  `Open` each driver with its committed driver checkpoint, then `Acknowledge` the
  recovered transaction (a recovery-log driver re-applies it). A driver whose
  store is behind Kafka (an empty store for a pipeline that has committed
  batches, a store restored from an old backup, a materialization added later)
  is backfilled in the next transaction: its Stores are then the whole current
  view, with `StartCommit.full_refresh`. A store *ahead* of Kafka (it committed,
  the Kafka transaction did not) needs nothing: view rows are a pure function of
  the input, so re-storing a key's final row is idempotent.
- `commit(checkpoint, changes, deltas, view)` after the reducer ran the batch and
  before the Kafka transaction: `Load` the keys the batch touched (each once;
  not waiting for `Acknowledged`), wait for `Acknowledged`, `Flush`, `Store` the
  final row per touched key and every delta row, `StartCommit` → the driver
  checkpoints, which the processor commits in the batch's Kafka transaction.
- `acknowledge(batch)` after the Kafka commit: `Acknowledge`, answered on a
  background thread while the next batch Loads.

Drivers with a `Sink` get their Stores split into parts by key, prepared by
`SinkWriter`s through an `Executor` (threads: the shard's task already runs on a
Spark executor), committed by the `SinkCommitter` with bounded retries of the failed
parts, then by the `AggregatedCommitter`.

Failures: a store's own error (a driver's `store_errors`, e.g. `sqlite3.Error`)
and a part that cannot be prepared or committed become `DriverError`, an
`OperationalError` chained to its cause; `DriverFencedError` and `ConfigError`
pass as they are. Either way nothing of the batch is committed to Kafka.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from refold.config import Pipeline
from refold.connectors.protocol import (
    Acknowledge,
    Acknowledged,
    Binding,
    CommitInfo,
    Driver,
    DriverError,
    Flush,
    Key,
    Load,
    Open,
    Opened,
    Row,
    RuntimeCheckpoint,
    Sink,
    SinkWriter,
    StartCommit,
    Store,
    TxnInfo,
    build_drivers,
)
from refold.errors import InternalError
from refold.recovery.records import Checkpoint
from refold.reduce import ViewChange

log = logging.getLogger(__name__)

ViewRows = Callable[[], Mapping[Key, Row]]


# Executors ------------------------------------------------------------------------------


class Executor(Protocol):
    def prepare(self, writer: SinkWriter, txn: TxnInfo, parts: Sequence[tuple[int, list[Store]]]) -> list[CommitInfo]:
        """Run `writer.prepare(txn, part, stores)` for every part; their results in part order."""
        ...


class ThreadExecutor:
    """Writers on threads, each on its own unpickled copy (as Spark would ship it)."""

    def __init__(self, threads: int = 4) -> None:
        self.threads = threads

    def prepare(self, writer: SinkWriter, txn: TxnInfo, parts: Sequence[tuple[int, list[Store]]]) -> list[CommitInfo]:
        shipped = pickle.dumps(writer)

        def run(item: tuple[int, list[Store]]) -> CommitInfo:
            copy: SinkWriter = pickle.loads(shipped)
            return copy.prepare(txn, item[0], item[1])

        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(parts)))) as pool:
            return list(pool.map(run, parts))


# The runtime ------------------------------------------------------------------------------


@dataclass
class _Driven:
    """One driver and where the runtime is with it."""

    driver: Driver[Any]
    name: str
    bindings: tuple[Binding, ...]
    view_index: int | None
    delta_index: int | None
    sink: Sink | None = None
    acked: Future[Acknowledged] | None = None
    backfill: bool = False


class Materializations:
    """Every materialization of one shard of a pipeline writer, driven through Flow's
    protocol. `writer` names the shard's sessions (`<writer>-<shard>`, see
    `refold.runtime.shards.shard_writer`; the pipeline's writer when not given): the
    owner in each driver's fence, runtime checkpoint and staged names."""

    def __init__(
        self,
        pipeline: Pipeline,
        drivers: Sequence[Driver[Any]],
        executor: Executor | None = None,
        writer: str | None = None,
        *,
        commit_attempts: int = 4,
        retry_seconds: float = 0.2,
    ) -> None:
        self.pipeline = pipeline
        self.writer = writer if writer is not None else pipeline.writer
        self.executor: Executor = executor or ThreadExecutor()
        self.commit_attempts = commit_attempts
        self.retry_seconds = retry_seconds
        self._acks = ThreadPoolExecutor(max_workers=max(1, len(drivers)), thread_name_prefix="refold-ack")
        self.driven = [self._describe(driver) for driver in drivers]
        self.transactions = 0

    @classmethod
    def from_pipeline(
        cls, pipeline: Pipeline, executor: Executor | None = None, writer: str | None = None
    ) -> Materializations | None:
        """The pipeline's `outputs.materialize` drivers (their settings validated when the
        pipeline was read; nothing connects before `open`), or None when it has none."""
        if not pipeline.outputs.materialize:
            return None
        return cls(pipeline, build_drivers(pipeline.outputs.materialize), executor, writer)

    def _describe(self, driver: Driver[Any]) -> _Driven:
        """The driver's bindings. The pipeline's validation guarantees at least one, and
        no delta binding on a top_n view."""
        settings = driver.settings
        spec = self.pipeline.view
        bindings: list[Binding] = []
        view_index = delta_index = None
        if settings.view is not None:
            if spec.top_n is not None:
                key = (*spec.top_n.partition_by, "place")
                columns: tuple[str, ...] = ()
            else:
                key, columns = tuple(spec.key), tuple(spec.columns)
            view_index = len(bindings)
            bindings.append(Binding("view", "view", settings.view, tuple(key), columns))
        if settings.delta is not None:
            delta_index = len(bindings)
            bindings.append(Binding("delta", "delta", settings.delta, tuple(spec.key), ("_count", *spec.columns)))
        return _Driven(driver, settings.materialization, tuple(bindings), view_index, delta_index)

    # Open / Acknowledge ---------------------------------------------------------------------

    def open(self, checkpoint: Checkpoint) -> None:
        """Open every driver at the last committed checkpoint and acknowledge it."""
        for driven in self.driven:
            self._settle(driven)
            driven.driver.close()
            request = Open(
                materialization=driven.name,
                pipeline=self.pipeline.pipeline,
                writer=self.writer,
                bindings=driven.bindings,
                driver_checkpoint=checkpoint.driver_checkpoints.get(driven.name),
            )
            with _store_failures(driven, "Open"):
                opened = driven.driver.open(request)
            if not isinstance(opened, Opened):
                raise InternalError(f"materialization {driven.name!r}: open returned {opened!r}, not Opened")
            driven.backfill = self._behind(driven, opened, checkpoint)
            driven.sink = driven.driver.sink()
            if driven.backfill:
                log.info("materialization %s is behind Kafka (batch %d): backfilling in the next batch",
                         driven.name, checkpoint.batch)
            driven.acked = self._acks.submit(_acknowledge, driven, checkpoint.batch)

    def _behind(self, driven: _Driven, opened: Opened, checkpoint: Checkpoint) -> bool:
        if driven.view_index is None:
            return False  # delta updates cannot be rebuilt from the view
        if driven.driver.pattern == "remote_authoritative":
            held = opened.runtime_checkpoint
            if held is None:
                return checkpoint.batch > 0
            if (held.pipeline, held.writer) != (self.pipeline.pipeline, self.writer):
                return True  # another pipeline's rows: replace them
            if held.batch > checkpoint.batch:
                log.info("materialization %s is ahead of Kafka (batch %d > %d): the replay re-stores it",
                         driven.name, held.batch, checkpoint.batch)
            return held.batch < checkpoint.batch
        return checkpoint.batch > 0 and driven.name not in checkpoint.driver_checkpoints

    @property
    def backfilling(self) -> bool:
        """Whether the next transaction stores the whole view (a driver behind Kafka)."""
        return any(driven.backfill for driven in self.driven)

    def acknowledge(self, batch: int) -> None:
        """The batch committed to Kafka: Acknowledge it to every driver (answered in the background)."""
        for driven in self.driven:
            self._settle(driven)
            driven.acked = self._acks.submit(_acknowledge, driven, batch)

    def settle(self) -> None:
        """Wait until every driver answered its Acknowledge (tests, shutdown)."""
        for driven in self.driven:
            self._settle(driven)

    def _settle(self, driven: _Driven) -> None:
        """Wait for the driver's Acknowledged (re-raising its failure)."""
        future, driven.acked = driven.acked, None
        if future is not None:
            answer = future.result()
            if not isinstance(answer, Acknowledged):
                raise InternalError(f"materialization {driven.name!r}: acknowledge returned {answer!r}")

    def close(self) -> None:
        for driven in self.driven:
            try:
                self._settle(driven)
            except Exception as exc:  # closing anyway; the next open re-applies
                log.warning("materialization %s: acknowledge failed while closing: %s", driven.name, exc)
            driven.driver.close()
        self._acks.shutdown(wait=True)

    # One transaction -------------------------------------------------------------------------

    def commit_units(
        self, checkpoint: Checkpoint, units: Sequence[tuple[Sequence[ViewChange], int]], deltas: Sequence[Row],
        view: ViewRows,
    ) -> dict[str, bytes]:
        """`commit` of a shard's batch: its view changes per unit, each unit's `cause` (a
        `refold.reduce.Changes`) the cause of the rows it leaves, as its view records name it."""
        changes: list[ViewChange] = []
        causes: dict[Key, str | None] = {}
        for unit_changes, _ in units:
            cause = getattr(unit_changes, "cause", None)
            named = None if cause is None or not self.pipeline.outputs.provenance else "{}:{}".format(*cause)
            for change in unit_changes:
                changes.append(change)
                causes[change.key] = named
        return self.commit(checkpoint, changes, deltas, view, causes)

    def commit(
        self, checkpoint: Checkpoint, changes: Sequence[ViewChange], deltas: Sequence[Row], view: ViewRows,
        causes: Mapping[Key, str | None] | None = None,
    ) -> dict[str, bytes]:
        """Run the transaction of the batch `checkpoint` is about to commit; return the
        driver checkpoints by materialization name. `causes`: each changed key's cause
        (`_cause` where the driver keeps one); a delta row's is its `causes` attribute's."""
        runtime_checkpoint = RuntimeCheckpoint(
            self.pipeline.pipeline, self.writer, checkpoint.batch, dict(checkpoint.offsets)
        )
        final: dict[Key, Row | None] = {}
        for change in changes:
            final[change.key] = change.row if change.op.adds else None
        checkpoints = dict(checkpoint.driver_checkpoints)
        for driven in self.driven:
            with _store_failures(driven, f"batch {checkpoint.batch}"):
                checkpoints[driven.name] = self._transaction(driven, runtime_checkpoint, final, deltas, view,
                                                             causes or {})
        self.transactions += 1
        return checkpoints

    def _transaction(
        self,
        driven: _Driven,
        runtime_checkpoint: RuntimeCheckpoint,
        final: Mapping[Key, Row | None],
        deltas: Sequence[Row],
        view: ViewRows,
        causes: Mapping[Key, str | None],
    ) -> bytes:
        driver = driven.driver
        full_refresh = driven.backfill
        stores: list[Store] = []
        if driven.view_index is not None:
            index = driven.view_index
            if full_refresh:
                rows = view()
                stores += [Store(index, key, dict(rows[key]), exists=False) for key in sorted(rows, key=_key_bytes)]
            else:
                exists = self._load(driven, index, list(final))
                stores += [
                    Store(index, key, None if row is None else dict(row), key in exists, delete=row is None,
                          cause=causes.get(key))
                    for key, row in final.items()
                ]
        self._settle(driven)  # Flush never before Acknowledged
        driver.flush(Flush())
        if driven.delta_index is not None:
            key_columns = driven.bindings[driven.delta_index].key
            index = driven.delta_index
            named = getattr(deltas, "causes", None) if self.pipeline.outputs.provenance else None
            stores += [Store(index, tuple(row[c] for c in key_columns), dict(row), exists=False,
                             cause=None if named is None or named[at] is None else "{}:{}".format(*named[at]))
                       for at, row in enumerate(deltas)]
        prepared: tuple[CommitInfo, ...] = ()
        if driven.sink is not None:
            prepared = self._prepare(driven, driven.sink, runtime_checkpoint.batch, stores)
        elif stores:
            driver.store(stores)
        start = StartCommit(runtime_checkpoint, prepared, full_refresh)
        if driven.sink is not None and driven.sink.aggregated is not None:
            driven.sink.aggregated.commit(prepared, start)
        started = driver.start_commit(start)
        driven.backfill = False
        return started.driver_checkpoint

    def _load(self, driven: _Driven, index: int, keys: list[Key]) -> set[Key]:
        """Load each key once; check the answers against the protocol."""
        if not keys:
            return set()
        loaded = driven.driver.load([Load(index, key) for key in keys])
        asked = set(keys)
        found: set[Key] = set()
        for answer in loaded:
            if answer.binding != index or answer.key not in asked or answer.key in found:
                raise InternalError(
                    f"materialization {driven.name!r}: Loaded for a key not loaded, or twice (binding {answer.binding})"
                )
            found.add(answer.key)
        return found

    def _prepare(self, driven: _Driven, sink: Sink, batch: int, stores: list[Store]) -> tuple[CommitInfo, ...]:
        if not stores:
            return ()
        count = driven.driver.settings.parallelism
        parts: list[list[Store]] = [[] for _ in range(count)]
        for store in stores:
            parts[zlib.crc32(orjson.dumps([store.binding, list(store.key)], default=str)) % count].append(store)
        work = [(part, items) for part, items in enumerate(parts) if items]
        txn = TxnInfo(driven.name, self.pipeline.pipeline, self.writer, batch, driven.bindings)
        try:
            infos = self.executor.prepare(sink.writer, txn, work)
        except Exception as exc:
            sink.writer.abort([])
            raise DriverError(
                f"materialization {driven.name!r}: preparing batch {batch} failed: {exc}", materialization=driven.name
            ) from exc
        if sink.committer is not None:
            failed = sink.committer.commit(infos)
            attempt = 1
            while failed and attempt < self.commit_attempts:
                log.warning("materialization %s: %d of %d parts failed to commit; retrying",
                            driven.name, len(failed), len(infos))
                time.sleep(self.retry_seconds * 2 ** (attempt - 1))
                failed = sink.committer.commit(failed)
                attempt += 1
            if failed:
                sink.writer.abort(infos)
                raise DriverError(
                    f"materialization {driven.name!r}: {len(failed)} parts of batch {batch} failed to commit "
                    f"after {self.commit_attempts} attempts",
                    materialization=driven.name,
                )
        return tuple(infos)


def _acknowledge(driven: _Driven, batch: int) -> Acknowledged:
    """Acknowledge one batch to one driver (on the acknowledging thread)."""
    with _store_failures(driven, f"Acknowledge of batch {batch}"):
        return driven.driver.acknowledge(Acknowledge(batch))


@contextlib.contextmanager
def _store_failures(driven: _Driven, step: str) -> Iterator[None]:
    """The store's own errors (`Driver.store_errors`) as DriverError, chained."""
    try:
        yield
    except driven.driver.store_errors as exc:
        raise DriverError(
            f"materialization {driven.name!r}: {step} failed: {type(exc).__name__}: {exc}",
            materialization=driven.name,
        ) from exc


def _key_bytes(key: Key) -> bytes:
    return orjson.dumps(list(key), default=str)
