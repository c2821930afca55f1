"""`refold run`: the Spark Structured Streaming job.

Spark's Kafka source reads the changelog topic (read_committed) in micro-batches;
`foreachBatch` hands each batch to the `BatchProcessor`, which splits it by shard
and commits each shard's outputs, state and offsets in the shard's own Kafka
transaction. The query
starts from the offsets committed in `P.checkpoints`; Spark's own checkpoint
directory is kept only while it agrees with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from refold import environment
from refold.config import Pipeline
from refold.connectors.runtime import SparkExecutor
from refold.errors import RefoldError, UserError
from refold.kafka.io import TopicSpec, ensure_topics, partitions_of
from refold.ops.monitor import Monitor
from refold.recovery.restore import reconcile_spark_checkpoint
from refold.runtime.batch import InputRecord
from refold.runtime.hooks import Hooks
from refold.runtime.processor import BatchProcessor, BatchStats

log = logging.getLogger(__name__)


def engine_topics(pipeline: Pipeline, partitions: int) -> list[TopicSpec]:
    """The topics the engine writes: its outputs and its recovery log (DESIGN.md §3).
    `P.state` and `P.checkpoints` get as many partitions as the source (or
    `partitions`): a shard's state goes to `P.state` partition = shard."""
    specs = [
        TopicSpec(pipeline.checkpoints_topic, partitions, compacted=True),
        TopicSpec(pipeline.state_topic, partitions, compacted=True),
        TopicSpec(pipeline.dlq_topic, 1),
    ]
    view = pipeline.outputs.view
    if view is not None:
        # A Top-N leaderboard is small and its places change together: one partition
        # keeps its changelog in one total order, as RFC-015 shows it.
        view_partitions = 1 if pipeline.view.is_top_n else partitions
        specs.append(TopicSpec(view.topic, view_partitions, compacted=view.form == "upsert"))
    if pipeline.outputs.delta is not None:
        specs.append(TopicSpec(pipeline.outputs.delta.topic, partitions))
    return specs


def spark_session(master: str = "local[2]", conf: dict[str, str] | None = None, name: str = "refold") -> Any:
    """A local-friendly Spark session with Spark's Kafka connector on the classpath."""
    _limit_malloc_arenas()  # before py4j's threads exist
    from pyspark.sql import SparkSession

    from refold.spark.jars import spark_jars

    # Python workers (materialization writers on executors) need this interpreter's packages
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.jars", ",".join(str(p) for p in spark_jars()))
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.streaming.kafka.useDeprecatedOffsetFetching", "false")
        .config("spark.driver.extraJavaOptions", "-Dlog4j2.level=WARN")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def spark_checkpoint_dir(pipeline: Pipeline) -> Path:
    if pipeline.spark.checkpoint_dir:
        return Path(pipeline.spark.checkpoint_dir)
    return environment.home() / "spark" / pipeline.pipeline / pipeline.writer


def starting_offsets(topic: str, partitions: list[int], committed: dict[int, int]) -> str:
    """Spark's startingOffsets JSON: Kafka's committed offsets, earliest (-2) elsewhere."""
    return orjson.dumps({topic: {str(p): committed.get(p, -2) for p in partitions}}).decode()


class Progress:
    """Prints one line per committed batch (stderr) and tracks idleness."""

    def __init__(self, pipeline: Pipeline, quiet: bool = False) -> None:
        self.pipeline = pipeline
        self.quiet = quiet
        self.started = time.monotonic()
        self.last_data = self.started
        self.last_commit: float | None = None
        self.left = self.started  # when the last foreachBatch call returned
        self.batches = 0
        self.events = 0
        self.failure: BaseException | None = None

    def committed(self, stats: BatchStats) -> None:
        self.last_data = self.last_commit = time.monotonic()
        self.batches += 1
        self.events += stats.records_in
        # the progress line, metrics and lag: refold.ops.monitor.Monitor


def run_pipeline(
    pipeline: Pipeline,
    bootstrap: str | None = None,
    until_idle: float | None = None,
    *,
    spark: Any = None,
    quiet: bool = False,
    processor_factory: Callable[[Pipeline, dict[str, Any], Any], BatchProcessor] | None = None,
    metrics_port: int | None = None,
    overlap: bool = True,
) -> Progress:
    """Run the engine until stopped (or until idle for `until_idle` seconds).

    `overlap=False` makes Spark wait for each batch's commit before it fetches the next
    (Spark's own foreachBatch contract, which an at-least-once writer relies on: the
    bench's Spark baseline); Refold's exactly-once does not need it."""
    _limit_malloc_arenas()
    # --bootstrap-servers, else REFOLD_BOOTSTRAP_SERVERS, else the pipeline's kafka:, else local
    settings = pipeline.kafka_settings(bootstrap)
    java_settings = pipeline.kafka.java()  # for Spark's source; fails before Spark starts
    topic = pipeline.source.topic
    try:
        partitions = partitions_of(settings, topic)
    except UserError as exc:
        raise UserError(f"source.topic: {exc}") from exc
    ensure_topics(settings, engine_topics(pipeline, max(pipeline.partitions, len(partitions))))
    own_spark = spark is None
    spark, processor = _start_engine(pipeline, settings, spark, processor_factory)
    progress = Progress(pipeline, quiet)
    monitor: Monitor | None = None
    on_batch: _BatchCallback | None = None
    query: Any = None
    # Whatever fails from here on (a metrics port in use, a bad Spark option, the query's
    # start), the batch worker, the processor's producer, the monitor and our Spark end.
    try:
        monitor = Monitor(pipeline, settings, metrics_port=metrics_port, quiet=quiet)
        monitor.start(processor)
        checkpoint_dir = spark_checkpoint_dir(pipeline)
        checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
        reconcile_spark_checkpoint(checkpoint_dir, topic, processor.offsets, settings)
        on_batch = _BatchCallback(processor, progress, monitor, overlap=overlap)
        reader = _source(spark, pipeline, settings, java_settings, starting_offsets(topic, partitions, processor.offsets))
        query = (
            reader.writeStream.foreachBatch(on_batch)
            .trigger(processingTime=f"{int(pipeline.trigger_seconds * 1000)} milliseconds")
            .option("checkpointLocation", str(checkpoint_dir))
            .queryName(f"refold-{pipeline.pipeline}")
            .start()
        )
        log.info("pipeline %s running: %s → view/delta (Spark checkpoint %s)",
                 pipeline.pipeline, topic, checkpoint_dir)
        _wait(query, progress, on_batch, until_idle)
    except KeyboardInterrupt:
        log.info("interrupted; stopping after the current batch")
    finally:
        if query is not None:
            query.stop()  # Spark's side; the worker is not Spark's and is never stopped mid-transaction
        if on_batch is not None:
            on_batch.close()
        processor.close()
        if monitor is not None:
            monitor.close()
        if on_batch is not None:
            on_batch.release()
        if own_spark:
            spark.stop()
    _raise_failure(progress, query)
    return progress


def _start_engine(
    pipeline: Pipeline,
    settings: dict[str, Any],
    spark: Any,
    processor_factory: Callable[[Pipeline, dict[str, Any], Any], BatchProcessor] | None,
) -> tuple[Any, BatchProcessor]:
    """Spark (ours when `spark` is None) and the processor; our Spark stops if the
    processor cannot start."""
    own_spark = spark is None
    if own_spark and processor_factory is None:
        return _start_together(pipeline, settings)
    if own_spark:
        spark = spark_session(pipeline.spark.master, pipeline.spark.conf, f"refold-{pipeline.pipeline}")
    try:
        if processor_factory is None:
            processor = BatchProcessor(pipeline, settings, SparkExecutor(spark.sparkContext), hooks=_test_hooks())
        else:
            processor = processor_factory(pipeline, settings, spark)
    except BaseException:
        if own_spark:
            spark.stop()
        raise
    return spark, processor


def _test_hooks() -> Hooks:
    """The chaos tests' hooks, from the environment (none in production)."""
    return Hooks.from_settings(environment.test_hook_settings())


def _source(spark: Any, pipeline: Pipeline, settings: dict[str, Any], java_settings: dict[str, str],
            start: str) -> Any:
    """The source topic as a streaming frame (read_committed) of the records' partition,
    offset, key, value and timestamp (epoch ms)."""
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", settings["bootstrap.servers"])
        .option("subscribe", pipeline.source.topic)
        .option("startingOffsets", start)
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", str(pipeline.max_batch_events))
        .option("failOnDataLoss", "false")
    )
    for key, value in java_settings.items():
        reader = reader.option(f"kafka.{key}", value)
    return reader.load().selectExpr("partition", "offset", "key", "value", "unix_millis(timestamp) AS ts")


def _wait(query: Any, progress: Progress, on_batch: _BatchCallback, until_idle: float | None) -> None:
    """Until the query ends, a batch fails, or the engine was idle for `until_idle` seconds."""
    while query.isActive:
        try:
            query.awaitTermination(0.25)
        except Exception:  # the query died: its cause is in progress.failure or query.exception()
            break
        if progress.failure is not None:
            break
        if until_idle is not None and on_batch.idle and _idle(query, progress, until_idle):
            break


def _raise_failure(progress: Progress, query: Any) -> None:
    """A failed batch's error (as it came when it is Refold's), else the query's."""
    if progress.failure is not None:
        failure = progress.failure
        if isinstance(failure, RefoldError):
            raise failure
        raise RefoldError(f"the engine failed: {failure}") from failure
    query_error = query.exception() if query is not None else None
    if query_error is not None:
        raise RefoldError(f"the streaming query failed: {query_error}") from query_error


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Two glibc malloc arenas instead of 8 per core (what `MALLOC_ARENA_MAX=2` does).

    Batches arrive on py4j's callback threads, and glibc gives threads arenas of their
    own: state freed in one arena was not reused by the next batch's thread, so the
    heap kept growing (measured, four 60k-key pipelines in one process: RSS 775 → 1,872
    MiB with the default, 781 → 802 MiB with two arenas set before Spark starts). Called
    before py4j's threads exist: an arena a thread already has stays. No effect off glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


_M_ARENA_MAX = -8  # glibc's malloc.h


def _start_together(pipeline: Pipeline, settings: dict[str, Any]) -> tuple[Any, BatchProcessor]:
    """Spark's session and the processor, started side by side: the JVM comes up (seconds,
    mostly outside Python) while the processor fences older instances and restores its
    state from Kafka (seconds to a minute, in Python). Recovery takes the longer of the
    two, not their sum."""
    executor = SparkExecutor()
    with ThreadPoolExecutor(1, thread_name_prefix="refold-spark-start") as pool:
        starting = pool.submit(spark_session, pipeline.spark.master, pipeline.spark.conf, f"refold-{pipeline.pipeline}")
        try:
            processor = BatchProcessor(pipeline, settings, executor, hooks=_test_hooks())
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().stop()
            raise
        try:
            spark = starting.result()
        except BaseException:
            processor.close()
            raise
    executor.attach(spark.sparkContext)
    return spark, processor


class _BatchCallback:
    """foreachBatch's function: Spark's thread fetches a batch and hands it over; the
    processor reduces and commits batches one after the other on a thread of its own.

    So Spark plans and fetches batch N+1 (mostly in the JVM) while batch N is reduced
    and committed (in Python): a batch costs the longer of the two, not their sum. One
    batch waits at most while one is processed. Exactly-once does not depend on it:
    Kafka's committed offsets are the truth, and Spark's checkpoint, which may now be a
    batch ahead of them after a crash, is kept only when it agrees
    (`reconcile_spark_checkpoint`).

    py4j keeps the callback referenced after the query stops; `release()` lets go of
    the processor (and its reducer's state), or a process that runs one pipeline after
    another (the tests, bench.scaling) would keep every finished pipeline's state.
    """

    def __init__(self, processor: BatchProcessor, progress: Progress, monitor: Monitor, *, overlap: bool = True) -> None:
        self.processor: BatchProcessor | None = processor
        self.overlap = overlap
        self.progress = progress
        self.monitor: Monitor | None = monitor
        self._turn = threading.Condition()
        self._waiting: list[InputRecord] | None = None  # handed over, not taken yet
        self._busy = False  # the worker is reducing or committing a batch
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="refold-batches", daemon=True)
        self._worker.start()

    @property
    def idle(self) -> bool:
        """No batch handed over and not yet committed."""
        with self._turn:
            return self._waiting is None and not self._busy

    def close(self) -> None:
        """Commit what was handed over, then end the worker (its processor's calls are bounded)."""
        with self._turn:
            self._closing = True
            self._turn.notify_all()
        self._worker.join()

    def release(self) -> None:
        self.processor = self.monitor = None

    def __call__(self, frame: Any, batch_id: int) -> None:
        entered = time.monotonic()
        self._raise_if_failed()
        table = frame.toArrow()
        if table.num_rows == 0:
            return
        fetched = time.monotonic()
        columns = table.to_pydict()
        records = [
            InputRecord(p, o, k, v, ts if ts is not None else 0)
            for p, o, k, v, ts in zip(
                columns["partition"], columns["offset"], columns["key"], columns["value"], columns["ts"],
                strict=True,
            )
        ]
        with self._turn:
            while self._waiting is not None and self.progress.failure is None and not self._closing:
                self._turn.wait(0.5)
            self._raise_if_failed()
            if self._closing:
                raise RefoldError("a batch arrived after the engine stopped")
            self._waiting = records
            self._turn.notify_all()
            while not self.overlap and (self._waiting is not None or self._busy):
                self._turn.wait()  # the worker always ends a batch with busy = False
        if not self.overlap:
            self._raise_if_failed()
        handed = time.monotonic()
        log.debug("spark batch %d: %d records; %.2fs in Spark before it, %.2fs to fetch, %.2fs waiting for "
                  "the batch before it", batch_id, table.num_rows, entered - self.progress.left,
                  fetched - entered, handed - fetched)
        self.progress.left = handed

    def _raise_if_failed(self) -> None:
        failure = self.progress.failure
        if failure is not None:
            raise RefoldError(f"the engine stopped after a failed batch: {failure}") from failure

    def _work(self) -> None:
        while True:
            with self._turn:
                while self._waiting is None and not self._closing:
                    self._turn.wait()
                if self._waiting is None:
                    return  # closing, and everything handed over is committed
                records, self._waiting = self._waiting, None
                self._busy = True
                self._turn.notify_all()
            try:
                self._process(records)
            except BaseException as exc:  # run_pipeline raises it
                self.progress.failure = exc
                return
            finally:
                with self._turn:
                    self._busy = False
                    self._turn.notify_all()

    def _process(self, records: list[InputRecord]) -> None:
        processor, monitor = self.processor, self.monitor
        if processor is None or monitor is None:
            raise RefoldError("a batch arrived after the engine stopped")
        started = time.monotonic()
        stats = processor.process(records)
        log.debug("processed %d records in %.2fs", len(records), time.monotonic() - started)
        self.progress.last_data = time.monotonic()
        if stats is not None:
            self.progress.committed(stats)
            monitor.committed(stats, processor.aborts)


def _idle(query: Any, progress: Progress, seconds: float) -> bool:
    status = query.status
    if status.get("isDataAvailable") or status.get("isTriggerActive"):
        return False
    if query.lastProgress is None and not str(status.get("message", "")).startswith("Waiting"):
        return False  # still initialising its sources
    return time.monotonic() - progress.last_data >= seconds
