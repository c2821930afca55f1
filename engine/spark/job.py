"""`refold run`: the Spark Structured Streaming job.

Spark's Kafka source reads the changelog topic (read_committed) in micro-batches;
`foreachBatch` runs each batch's shards as Spark tasks on the executors
(`refold.spark.tasks`): each task reduces its shard's records and commits its
outputs, state and offsets in the shard's own Kafka transaction. The driver fences
the shards at start, computes the starting offsets from the checkpoints committed in
`P.checkpoints`, and collects each task's summary; it reduces nothing. Spark's own
checkpoint directory is kept only while it agrees with Kafka's offsets.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from refold import environment
from refold.config import Pipeline
from refold.errors import RefoldError, UserError
from refold.kafka.io import TopicSpec, durability_warnings, ensure_topics, partitions_of
from refold.ops.monitor import Monitor
from refold.plan import RIGHT_PARTITIONS, Plan, plan_of
from refold.recovery.claims import claim_shards
from refold.recovery.layout import check_plan_view_partitions, settle_plan, settled
from refold.recovery.records import combined
from refold.recovery.restore import reconcile_spark_checkpoint
from refold.runtime.exchange import Closer, Trimmer
from refold.runtime.hooks import Hooks
from refold.runtime.joinread import check_join_partitions
from refold.runtime.processor import BatchStats, together, with_outputs
from refold.runtime.shards import check_state_partitions
from refold.spark import logs
from refold.spark.launch import check_master as check_master
from refold.spark.launch import java_options as java_options
from refold.spark.launch import limit_malloc_arenas
from refold.spark.launch import local_with_retries as local_with_retries
from refold.spark.launch import spark_session as spark_session
from refold.spark.placement import run_shards
from refold.spark.tasks import SUMMARY, ShardTask, reported_error, summary_offsets, summary_stats

log = logging.getLogger(__name__)


def prepare_topics(plan: Plan, settings: dict[str, Any]) -> list[TopicSpec]:
    """Create the plan's topics that do not exist yet (`Plan.engine_topics`, with the
    pipeline's `replication_factor`, else min(3, brokers) replicas), and log a warning
    for each durability setting that weakens exactly-once on a cluster of several
    brokers (`durability_warnings`: one replica, or min.insync.replicas 1)."""
    pipeline = plan.pipeline
    specs = plan.engine_topics()
    ensure_topics(settings, specs, replication_factor=pipeline.replication_factor)
    for warning in durability_warnings(settings, [pipeline.source.topic, *(spec.name for spec in specs)]):
        log.warning("pipeline %s: %s", pipeline.pipeline, warning)
    return specs


def engine_topics(pipeline: Pipeline, partitions: int) -> list[TopicSpec]:
    """The topics a new pipeline's first run makes over a source of `partitions`
    partitions (the plan's, `Plan.engine_topics`): its outputs and its recovery log
    (DESIGN.md §3), and a re-grouping view's exchange."""
    return plan_of(settled(pipeline, {}, partitions), partitions).engine_topics()


def spark_checkpoint_dir(pipeline: Pipeline) -> Path:
    if pipeline.spark.checkpoint_dir:
        return Path(pipeline.spark.checkpoint_dir)
    return environment.home() / "spark" / pipeline.pipeline / pipeline.writer


def starting_offsets(topic: str, partitions: list[int], committed: dict[int, int],
                     right: tuple[str, list[int]] | None = None) -> str:
    """Spark's startingOffsets JSON: Kafka's committed offsets, earliest (-2) elsewhere;
    `right`: a join's right source (topic, partitions), its offsets in `committed`
    numbered `RIGHT_PARTITIONS` + p."""
    offsets = {topic: {str(p): committed.get(p, -2) for p in partitions}}
    if right is not None:
        offsets[right[0]] = {str(p): committed.get(RIGHT_PARTITIONS + p, -2) for p in right[1]}
    return orjson.dumps(offsets).decode()


class Progress:
    """Prints one line per committed batch (stderr) and tracks idleness."""

    def __init__(self, pipeline: Pipeline, quiet: bool = False) -> None:
        self.pipeline = pipeline
        self.quiet = quiet
        self.started = time.monotonic()
        self.last_data = self.started
        self.last_commit: float | None = None
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
    metrics_port: int | None = None,
    log_format: str | None = None,
) -> Progress:
    """Run the engine until stopped (or until idle for `until_idle` seconds).

    The driver fences every shard's writer (settling transactions an earlier run left
    open), reads the committed checkpoints for the starting offsets, and runs each
    micro-batch's shards as Spark tasks (`refold.spark.tasks`). `log_format`: the batch
    lines' (`refold.ops.monitor`), "text" or "json"; by default text on a terminal."""
    if (refusal := pipeline.run_refusal()) is not None:
        raise UserError(refusal)
    limit_malloc_arenas()
    if spark is None:
        check_master(pipeline.spark.master)  # before any topic is made
    # --bootstrap-servers, else REFOLD_BOOTSTRAP_SERVERS, else the pipeline's kafka:, else local
    settings = pipeline.kafka_settings(bootstrap)
    java_settings = pipeline.kafka.java()  # for Spark's source; fails before Spark starts
    topic = pipeline.source.topic
    try:
        partitions = partitions_of(settings, topic)
    except UserError as exc:
        raise UserError(f"source.topic: {exc}") from exc
    count = len(partitions)
    if pipeline.view.join is not None and isinstance(pipeline.shards, int):  # stage 1: a shard per partition of either
        count = max(count, check_join_partitions(pipeline, settings, count))
    plan = settle_plan(pipeline, settings, count)  # the pipeline's shape, read from here on
    pipeline = plan.pipeline
    right = None  # a join's right source: (topic, partitions)
    if pipeline.view.join is not None:
        check_join_partitions(pipeline, settings, len(partitions))
        right_topic = pipeline.sources[pipeline.view.join.right].topic
        right = (right_topic, partitions_of(settings, right_topic))
    prepare_topics(plan, settings)
    check_plan_view_partitions(plan, settings)
    own_spark = spark is None
    spark, start = _start_engine(plan, settings, spark)
    progress = Progress(pipeline, quiet)
    monitor: Monitor | None = None
    query: Any = None
    on_batch: _Batches | None = None
    # Whatever fails from here on (a metrics port in use, a bad Spark option, the query's
    # start), the monitor and our Spark end.
    try:
        monitor = Monitor(pipeline, settings, metrics_port=metrics_port, quiet=quiet, log_format=log_format)
        monitor.start(start)
        checkpoint_dir = spark_checkpoint_dir(pipeline)
        checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
        if right is None:
            reconcile_spark_checkpoint(checkpoint_dir, topic, start.offsets, settings)
        elif checkpoint_dir.exists():  # a join's run starts from Kafka's offsets of both sources
            shutil.rmtree(checkpoint_dir)
        on_batch = _Batches(pipeline, settings, start, progress, monitor)
        if start.closer is not None:  # what the last run's stage 1 committed and its stage 2 did not
            on_batch.account([], on_batch.apply(spark), 0.0)
        reader = _source(spark, pipeline, settings, java_settings,
                         starting_offsets(topic, partitions, start.offsets, right), right)
        query = (
            reader.writeStream.foreachBatch(on_batch)
            .trigger(processingTime=f"{int(pipeline.trigger_seconds * 1000)} milliseconds")
            .option("checkpointLocation", str(checkpoint_dir))
            .queryName(f"refold-{pipeline.pipeline}")
            .start()
        )
        log.info("pipeline %s running: %s → view/delta, %d shard(s) as Spark tasks (Spark checkpoint %s)",
                 pipeline.pipeline, topic if right is None else f"{topic} ⋈ {right[0]}", len(start.shards), checkpoint_dir)
        _wait(query, progress, until_idle)
    except KeyboardInterrupt:
        log.info("interrupted; stopping after the current batch")
    finally:
        if query is not None:
            query.stop()
        if on_batch is not None:
            on_batch.finish()  # the last batch's stage 2, still running
        if monitor is not None:
            monitor.close()
        if start.closer is not None:
            start.closer.shutdown()
        if own_spark:
            spark.stop()
    _raise_failure(progress, query)
    return progress


class Start:
    """What the driver settles before the query starts (`claim_shards`): every shard of
    every stage of the plan fenced and its checkpoint claimed for this run, the committed
    offsets (`offsets`, kept current from the tasks' summaries for the monitor's lag),
    the run's id, and `P.checkpoints`' partition count."""

    def __init__(self, plan: Plan, settings: dict[str, Any]) -> None:
        started = time.monotonic()
        pipeline = plan.pipeline
        self.run = int(time.time() * 1000)
        self.plan = plan
        self.shards = plan.first.shard_indexes
        state_partitions = len(partitions_of(settings, pipeline.state_topic))
        for stage in plan.stages:
            if stage.state_topic == pipeline.state_topic or stage is plan.first:
                for index in stage.shard_indexes:
                    check_state_partitions(pipeline, state_partitions, index)
        self.checkpoint_partitions = len(partitions_of(settings, pipeline.checkpoints_topic))
        claimed = claim_shards(pipeline, settings, self.shards, self.run, self.checkpoint_partitions)
        for stage in plan.later:  # a re-grouping view's stage 2 (and a global Top-N's stage 3)
            claim_shards(stage.pipeline, settings, stage.shard_indexes, self.run, self.checkpoint_partitions)
        self.closer: Closer | None = Closer(pipeline, settings) if plan.close_id is not None else None
        committed = combined([c for c in claimed.values() if c.batch > 0])
        self.offsets: dict[int, int] = dict(committed.offsets) if committed is not None else {}
        self.aborts = 0
        log.info("recovered %s: %d shard(s) fenced and claimed for run %d, batch %d, offsets %s (%.1fs)",
                 pipeline.pipeline, len(self.shards), self.run, committed.batch if committed else 0,
                 self.offsets, time.monotonic() - started)


def _start_engine(plan: Plan, settings: dict[str, Any], spark: Any) -> tuple[Any, Start]:
    """Spark (ours when `spark` is None) and the run's start, side by side: the JVM comes
    up (seconds, mostly outside Python) while the shards are fenced and the checkpoints
    read. Our Spark stops when the start fails."""
    if spark is not None:
        return spark, Start(plan, settings)
    pipeline = plan.pipeline
    with ThreadPoolExecutor(1, thread_name_prefix="refold-spark-start") as pool:
        starting = pool.submit(spark_session, pipeline.spark.master, pipeline.spark.conf, f"refold-{pipeline.pipeline}")
        try:
            start = Start(plan, settings)
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().stop()
            raise
        return starting.result(), start


def _test_hooks() -> Hooks:
    """The chaos tests' hooks, from the environment (none in production)."""
    return Hooks.from_settings(environment.test_hook_settings())


def _source(spark: Any, pipeline: Pipeline, settings: dict[str, Any], java_settings: dict[str, str],
            start: str, right: tuple[str, list[int]] | None = None) -> Any:
    """The source topic as a streaming frame (read_committed) of the records' partition,
    offset, key, value and timestamp (epoch ms); for a join, both sources', the right
    one's partition p numbered `RIGHT_PARTITIONS` + p (`refold.runtime.joins`)."""
    topics = pipeline.source.topic if right is None else f"{pipeline.source.topic},{right[0]}"
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", settings["bootstrap.servers"])
        .option("subscribe", topics)
        .option("startingOffsets", start)
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", str(pipeline.max_batch_events))
        .option("failOnDataLoss", "false")
        # a task reads a planned range of records that exist: a fetch at a range's end
        # (past a transaction's last record, only its marker follows) would wait the
        # consumer's default 500 ms for data that is not coming
        .option("kafka.fetch.max.wait.ms", "10")
    )
    for key, value in java_settings.items():
        reader = reader.option(f"kafka.{key}", value)
    partition = "partition" if right is None else \
        f"IF(topic = '{right[0]}', partition + {RIGHT_PARTITIONS}, partition) AS partition"
    return reader.load().selectExpr(partition, "offset", "key", "value", "unix_millis(timestamp) AS ts")


_STOP = threading.Event()  # set by `request_stop`: the run ends after the batch in flight


def request_stop() -> None:
    """Ask the running pipeline to stop after the batch in flight (`refold run`'s SIGTERM
    handler; safe in a signal handler: it only sets a flag `_wait` reads)."""
    _STOP.set()


def _wait(query: Any, progress: Progress, until_idle: float | None) -> None:
    """Until the query ends, a batch fails, the engine was idle for `until_idle` seconds, or
    a stop was requested."""
    while True:
        if _STOP.is_set():
            log.info("stop requested; stopping after the current batch")
            break
        try:
            ended = query.awaitTermination(0.25)  # one JVM call a quarter second while batches come
        except Exception:  # the query died: its cause is in progress.failure or query.exception()
            break
        if ended or progress.failure is not None:
            break
        if until_idle is not None and _idle(query, progress, until_idle):
            break


def _raise_failure(progress: Progress, query: Any) -> None:
    """A failed batch's error (as it came when it is Refold's), else the query's."""
    if progress.failure is not None:
        # let go of it before it is raised here: it takes the caller's frames into its
        # traceback, and foreachBatch's function (which py4j may keep for long) holds progress
        failure, progress.failure = progress.failure, None
        if isinstance(failure, RefoldError):
            raise failure
        said = logs.first_line(failure) if logs.from_spark(failure) else failure  # a JVM error's message carries its stack
        raise RefoldError(f"the engine failed: {said}") from failure
    query_error = query.exception() if query is not None else None
    if query_error is not None:
        raise RefoldError(f"the streaming query failed: {logs.first_line(query_error)}") from query_error


class _Batches:
    """foreachBatch's function: runs the batch's shards as Spark tasks (`ShardTask` in
    `mapInArrow`, one task per source partition, or one for the whole batch when the view
    is not co-partitioned) and collects their summaries: the batch's stats, the shards'
    offsets, and the first Refold error a shard reported (raised here as it is)."""

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], start: Start, progress: Progress,
                 monitor: Monitor) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.start = start
        self.progress = progress
        self.monitor = monitor
        self.hooks = _test_hooks()
        self.first = True  # no batch with records ran yet in this run
        # a re-grouping view's later stages of batch b run here beside stage 1 of batch b+1
        self._later = ThreadPoolExecutor(1, thread_name_prefix="refold-later-stages")
        self._running: Future[None] | None = None
        self._aborts: dict[tuple[int, int, int], int] = {}  # (stage, shard, worker) -> its last reported count
        self.trimmer = Trimmer(settings)  # the records the later stages read, deleted off the batch's path

    def __call__(self, frame: Any, batch_id: int) -> None:
        if self.progress.failure is not None:
            raise RefoldError(f"the engine stopped after a failed batch: {self.progress.failure}")
        try:
            self._batch(frame, batch_id)
            return
        except BaseException as exc:
            if exc is not self.progress.failure:
                raise
        # Spark gets an exception of its own, raised outside the handler (no __context__):
        # pyspark keeps what foreachBatch raised as long as py4j keeps the function, and
        # the failure goes on to run_pipeline's caller, whose frames it then holds
        raise RefoldError(f"the batch failed: {self.progress.failure}")

    def _batch(self, frame: Any, batch_id: int) -> None:
        began = time.monotonic()
        task = ShardTask(self.pipeline, self.settings, self.hooks, self.start.run,
                         self.start.checkpoint_partitions, self.first,
                         stage="route" if self.start.closer is not None else "view")
        if not self.start.plan.co_partitioned:
            frame = frame.coalesce(1)
        elif self.pipeline.view.join is not None:  # shard p's task: partition p of both sources
            frame = frame.repartition(len(self.start.shards), frame["partition"] % RIGHT_PARTITIONS)
        rows = [row.asDict() for row in frame.mapInArrow(task, SUMMARY).collect()]
        self.settle()  # the last batch's later stages, which ran beside this stage 1
        if not rows:
            return
        self.first = False
        try:
            if self.start.closer is not None and not any(row["error_kind"] for row in rows):
                # closed now, before the next batch's stage 1 routes anything
                close = self.start.closer.close(self.start.run)
                self._running = self._later.submit(self._later_stages, frame.sparkSession, rows, close, began)
                log.debug("spark batch %d: stage 1 %.2fs", batch_id, time.monotonic() - began)
                return
            self.account(rows, [], time.monotonic() - began)
        except BaseException as exc:
            self.progress.failure = exc
            raise
        log.debug("spark batch %d: %d shard task(s) in %.2fs", batch_id, len(rows), time.monotonic() - began)

    def _later_stages(self, spark: Any, rows: list[dict[str, Any]], close: bytes, began: float) -> None:
        """A re-grouping view's stage 2 (and 3) of a batch whose stage 1 committed `rows`,
        beside the next batch's stage 1 (as Kafka Streams runs its sub-topologies)."""
        try:
            started = time.monotonic()
            self.account(rows, self.apply(spark, close), time.monotonic() - began)
            log.debug("later stages %.2fs", time.monotonic() - started)
        except BaseException as exc:
            self.progress.failure = exc
            raise

    def settle(self) -> None:
        """Wait for the last batch's later stages; their error is raised here."""
        running, self._running = self._running, None
        if running is not None:
            running.result()

    def finish(self) -> None:
        """At the run's end: the last batch's later stages done (an error in them is the
        run's failure), the thread gone."""
        with contextlib.suppress(BaseException):
            self.settle()
        self._later.shutdown()
        self.trimmer.wait()

    def _new_aborts(self, rows: list[dict[str, Any]], applied: list[dict[str, Any]]) -> int:
        """The transactions run again since the tasks' last reports: each row carries its
        processor's count so far (a new processor of a shard counts from 0 again)."""
        new = 0
        for stage, reported in ((1, rows), (2, applied)):
            for row in reported:
                key = (row.get("stage", stage), row["shard"], row["worker"])
                seen = self._aborts.get(key, 0)
                new += row["aborts"] - seen if row["aborts"] >= seen else row["aborts"]
                self._aborts[key] = row["aborts"]
        return new

    def apply(self, spark: Any, close: bytes | None = None) -> list[dict[str, Any]]:
        """A re-grouping view's stage 2: the batch closed (unless `close` is its close
        record), then one task per shard."""
        assert self.start.closer is not None
        close = close or self.start.closer.close(self.start.run)
        task = ShardTask(self.pipeline, self.settings, self.hooks, self.start.run,
                         self.start.checkpoint_partitions, False, stage="apply", close=close)
        reduce = self.start.plan.stages[1]  # (a re-grouping view's reduce, a join's join)
        assert reduce.shards is not None
        rows = run_shards(spark, task, reduce.shards)  # each shard on its executor, batch after batch
        self.trimmer.trim(reduce.inputs[0], summary_offsets(rows))
        if self.start.plan.regrouped and not any(row["error_kind"] for row in rows):  # a regrouping join's stage 3
            group = self.start.plan.stage("reduce")
            close = self.start.closer.close(self.start.run, regroup=True)
            assert group.shards is not None
            grouped = [{**row, "stage": 3} for row in run_shards(spark, replace(task, stage="group", close=close),
                                                                 group.shards)]
            self.trimmer.trim(group.inputs[0], summary_offsets(grouped))
            rows += grouped
        if self.start.plan.ranked_globally and not any(row["error_kind"] for row in rows):  # stage 3
            rank = self.start.plan.stage("rank")
            close = self.start.closer.close(self.start.run, tops=True)
            task = replace(task, stage="top", close=close)
            ranked = [{**row, "stage": 3} for row in run_shards(spark, task, 1)]
            self.trimmer.trim(rank.inputs[0], summary_offsets(ranked))
            rows += ranked
        return rows

    def account(self, rows: list[dict[str, Any]], applied: list[dict[str, Any]], seconds: float) -> None:
        """The batch's stats from its tasks' summaries (`rows`; a re-grouping view's
        stage 2: `applied`, whose offsets are of P.repartition), and its first error."""
        committed: list[BatchStats] = []
        offsets = dict(self.start.offsets)
        for stage, reported in ((1, rows), (2, applied)):
            for row in reported:
                shard = f"stage {row.get('stage', stage)} shard {row['shard']}" if stage > 1 else f"shard {row['shard']}"
                if row["recovered"] is not None:  # a new processor of the shard on some worker
                    log.info("%s started on worker pid %d: state store %s (%s)", shard, row["worker"],
                             row["recovered"], row["recovery"])
                if row["attempt"]:
                    store = {"as_is": "was current", "caught_up": "caught up from P.state",
                             "restored": "was restored from P.state"}.get(row["recovered"], "was not needed")
                    log.warning("%s ran again as attempt %d of its task (an earlier attempt failed; "
                                "nothing is committed twice); its state store %s", shard, row["attempt"], store)
        for row in rows:
            offsets.update({int(p): o for p, o in orjson.loads(row["offsets"]).items()})
            if row["error_kind"] is None and row["batch"] > 0:
                committed.append(summary_stats(row))
        self.start.offsets = offsets  # replaced whole: the monitor's thread reads it
        self.start.aborts += self._new_aborts(rows, applied)
        if committed:
            stats = together(committed, seconds)
            stats = with_outputs(stats, [summary_stats(r) for r in applied if r["error_kind"] is None and r["batch"] > 0])
            self.progress.last_data = time.monotonic()
            self.progress.committed(stats)
            self.monitor.committed(stats, self.start.aborts)
        failed = [row for row in [*rows, *applied] if row["error_kind"] is not None]
        if failed:
            first = min(failed, key=lambda row: row["shard"])
            raise reported_error(first)


def _idle(query: Any, progress: Progress, seconds: float) -> bool:
    if time.monotonic() - progress.last_data < seconds:
        return False  # data came lately: no need to ask the query (two JVM calls)
    status = query.status
    if status.get("isDataAvailable") or status.get("isTriggerActive"):
        return False
    if query.lastProgress is None and not str(status.get("message", "")).startswith("Waiting"):
        return False  # still initialising its sources
    return time.monotonic() - progress.last_data >= seconds
