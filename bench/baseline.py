"""The at-least-once baseline: what a Spark user writes with `foreachBatch`.

The same reducer as `refold run` (Refold's `BatchProcessor`: the same decode, pairing,
merge, reduction and rendering, the same micro-batch size), but run on the **driver**:
a streaming query of its own over the same Kafka source (`refold.spark.job._source`,
read_committed, `maxOffsetsPerTrigger = max_batch_events`) whose `foreachBatch`
collects each micro-batch to Arrow on the driver (`DataFrame.toArrow`), hands the
records to `SparkSinkProcessor.process`, and writes the view and delta records through
Spark's built-in Kafka sink (`df.write.format("kafka")`). Spark runs the next batch
only when `foreachBatch` returned (its own contract), so every batch is written before
Spark commits its offsets to its checkpoint: **at least once** — a crash between the
write and Spark's offset commit writes the batch again. No Kafka transaction, no state
changelog, no checkpoint record, no local state store: the state lives in the
driver's memory for the life of the query (`SparkSinkShard`). Used by `make bench`
(`bench.run`, contender "spark-sink") to price Refold's exactly-once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from refold.config import Pipeline
from refold.errors import RefoldError
from refold.kafka.io import ensure_topics, partitions_of
from refold.recovery.records import Checkpoint
from refold.reduce import make_reducer
from refold.runtime.batch import InputRecord
from refold.runtime.batch import Outgoing as _Outgoing
from refold.runtime.processor import BatchProcessor, ShardProcessor
from refold.spark.job import (
    Progress,
    _source,
    _wait,
    engine_topics,
    spark_checkpoint_dir,
    starting_offsets,
)


class SparkSinkProcessor(BatchProcessor):
    """Reduces exactly like BatchProcessor; writes with Spark's Kafka sink, at least once."""

    def __init__(self, pipeline: Pipeline, settings: dict[str, Any], spark: Any) -> None:
        self.spark = spark
        self.shard_type = SparkSinkShard
        super().__init__(pipeline, settings)

    def _make_shard(self, index: int) -> ShardProcessor:
        shard = super()._make_shard(index)
        assert isinstance(shard, SparkSinkShard)
        shard.spark = self.spark
        return shard


class SparkSinkShard(ShardProcessor):
    """One shard of the baseline: no transactions, no recovery log, no local store. Its
    reducer holds the whole state in the driver's memory."""

    spark: Any = None

    def lock(self) -> None:  # no local store
        pass

    def suspend(self) -> None:  # no store to let go of
        pass

    def resume(self) -> bool:  # nobody else runs this shard: always current
        return True

    def fence(self) -> None:  # no transactions
        pass

    def restore(self) -> None:  # no recovery log: Spark's checkpoint only
        self.checkpoint = Checkpoint(
            pipeline=self.pipeline.pipeline, writer=self.pipeline.writer, batch=0,
            source_topic=self.topic, offsets={}, pending={}, records_in=0, records_out=0,
            dlq=0, committed_at=0, driver_checkpoints={}, shard=self.shard,
        )
        self.reducer = make_reducer(self.pipeline.view)

    def _load(self, touched: set[Any], *, forget: bool = True) -> None:  # the reducer holds every key already
        pass

    def _stamp(self, state: Sequence[tuple[bytes, bytes | None]], checkpoint: Checkpoint) -> None:  # no store
        pass

    def _commit(self, out: _Outgoing, checkpoint: Checkpoint) -> None:
        topics: list[str] = []
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        if self.pipeline.outputs.view is not None:
            for key, value, _ts, _headers in out.view:
                topics.append(self.pipeline.outputs.view.topic)
                keys.append(key)
                values.append(value)
        if self.pipeline.outputs.delta is not None:
            for key, value, _headers in out.delta:
                topics.append(self.pipeline.outputs.delta.topic)
                keys.append(key)
                values.append(value)
        if not topics:
            return
        table = pa.table({"topic": topics, "key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary())})
        (
            self.spark.createDataFrame(table.to_pandas())
            .write.format("kafka")
            .option("kafka.bootstrap.servers", self.settings["bootstrap.servers"])
            .save()
        )


def records_of(table: pa.Table) -> list[InputRecord]:
    """A batch's Arrow table (partition, offset, key, value, ts) as the processor's records."""
    columns = table.to_pydict()
    return [
        InputRecord(p, o, k, v, ts if ts is not None else 0)
        for p, o, k, v, ts in zip(
            columns["partition"], columns["offset"], columns["key"], columns["value"], columns["ts"], strict=True
        )
    ]


class _Batches:
    """foreachBatch's function: the batch collected to Arrow on the driver, reduced and
    written there; returns when the batch is written (Spark then commits its offsets)."""

    def __init__(self, processor: SparkSinkProcessor, progress: Progress) -> None:
        self.processor = processor
        self.progress = progress

    def __call__(self, frame: Any, batch_id: int) -> None:
        if self.progress.failure is not None:
            raise RefoldError(f"the baseline stopped after a failed batch: {self.progress.failure}")
        try:
            records = records_of(frame.toArrow())
            if not records:
                return
            stats = self.processor.process(records)
            if stats is not None:
                self.progress.committed(stats)
        except BaseException as exc:
            self.progress.failure = exc
            raise


def run_baseline(pipeline: Pipeline, bootstrap: str | None, spark: Any, until_idle: float = 5.0) -> Progress:
    """Run the baseline over `pipeline`'s source from the beginning until idle for
    `until_idle` seconds. Returns its `Progress` (`started`: when the query is about to
    start, after the processor exists; `last_commit`: when the last batch was written)."""
    settings = pipeline.kafka_settings(bootstrap)
    java_settings = pipeline.kafka.java()
    topic = pipeline.source.topic
    partitions = partitions_of(settings, topic)
    # the output topics, and the recovery log's that BatchProcessor's start checks (unused here)
    ensure_topics(settings, engine_topics(pipeline, max(pipeline.partitions, len(partitions))))
    processor = SparkSinkProcessor(pipeline, settings, spark)
    progress = Progress(pipeline, quiet=True)
    query: Any = None
    try:
        checkpoint_dir = spark_checkpoint_dir(pipeline)
        checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
        reader = _source(spark, pipeline, settings, java_settings,
                         starting_offsets(topic, partitions, processor.offsets))
        query = (
            reader.writeStream.foreachBatch(_Batches(processor, progress))
            .trigger(processingTime=f"{int(pipeline.trigger_seconds * 1000)} milliseconds")
            .option("checkpointLocation", str(checkpoint_dir))
            .queryName(f"bench-baseline-{pipeline.pipeline}")
            .start()
        )
        _wait(query, progress, until_idle)
    finally:
        if query is not None:
            query.stop()
        processor.close()
    if progress.failure is not None:
        raise RefoldError(f"the baseline failed: {progress.failure}") from progress.failure
    error = query.exception() if query is not None else None
    if error is not None:
        raise RefoldError(f"the baseline's streaming query failed: {error}")
    return progress

