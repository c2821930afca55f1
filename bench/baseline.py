"""The at-least-once baseline: the same Spark pipeline and reduction as `refold run`,
but its outputs go through Spark's built-in Kafka sink (`df.write.format("kafka")`)
with no transaction, no state changelog and no checkpoint record — what Spark offers
today. Used by `make bench` to price exactly-once.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from refold.config import Pipeline
from refold.recovery.records import Checkpoint
from refold.reduce import make_reducer
from refold.runtime.batch import Outgoing as _Outgoing
from refold.runtime.processor import BatchProcessor, ShardProcessor


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
    """One shard of the baseline: no transactions, no recovery log."""

    spark: Any = None

    def fence(self) -> None:  # no transactions
        pass

    def restore(self) -> None:  # no recovery log: Spark's checkpoint only
        self.checkpoint = Checkpoint(
            pipeline=self.pipeline.pipeline, writer=self.pipeline.writer, batch=0,
            source_topic=self.topic, offsets={}, pending={}, records_in=0, records_out=0,
            dlq=0, committed_at=0, driver_checkpoints={}, shard=self.shard,
        )
        self.reducer = make_reducer(self.pipeline.view)

    def _commit(self, out: _Outgoing, checkpoint: Checkpoint) -> None:
        topics: list[str] = []
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        if self.pipeline.outputs.view is not None:
            for key, value, _ts in out.view:
                topics.append(self.pipeline.outputs.view.topic)
                keys.append(key)
                values.append(value)
        if self.pipeline.outputs.delta is not None:
            for key, value in out.delta:
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
